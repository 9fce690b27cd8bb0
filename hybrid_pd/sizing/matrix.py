"""A profile fitted from the real-scale goodput matrix, and the simulator's predictions checked against that matrix.

The matrix (docs/performance.md: Nemotron-H-8B, two H100s, vLLM 0.26.0, ``vllm bench serve``)
measured, per workload and requests in flight, colocated replicas (``replicas``) and a fixed
1 prefill + 1 decode split (``pd``) on the same two GPUs. No profile was measured on its own,
so :func:`fit` takes each profile quantity from the rows that show it most directly and names
them (:data:`FITS`); every other figure of every row is a prediction (:mod:`.check`):

- **decode step**: TPOT mean of the replicas at 1 in flight (one sequence decoding, every
  workload) and of the fixed split's decode worker at 32 and 64 in flight at the two ends of the
  matrix's context range (200/1000 and 3000/128: 700 and 3064 tokens of context on average, so the
  context term is pinned and 1000/64 and 1000/512 are predicted), against the decoding batch, by
  least squares (coefficients >= 0). The batch at 1 in flight is 1; at 32 and 64 it is Little's
  law over the run, requests x decode time / duration (a closed loop's waves, and at 3000/128 the
  prefill GPU, leave it below the level). Context tokens are batch x (prompt + half the output).
- **prefill per token**: the throughput of the fixed split at 3000/128, 64 in flight, where the one
  prefill GPU is the bottleneck (TTFT 3.9 s), matched by the simulator (bisection).
- **prompt latency**: replicas' TTFT p50 at 1 in flight, per prompt length, less the simulated
  step of that prompt (what is left holds no GPU: at full load the prefill GPU computes ~35k
  tokens/s, which a lone 1000-token prompt's 66-72 ms TTFT is far from).
- **hand-off**: the median over workloads of the fixed split's TTFT p50 at 1 in flight less the
  replicas' at the same workload, less the transfer and the decode worker's first step.
- **transfer**: not in the matrix; vLLM's transfer at 1 in flight (2.30 ms for the same model's
  119 MB, ``vllm_xfer_ms_avg``) and the NIXL floor of one descriptor across GPUs (its bandwidth),
  on two H200s (``2026-11-23-h200x2-real-scale-sweep.json``), whose config also gives the shape.
- **memory and scheduler**: the servers' settings the matrix records (8 GiB KV cache, 128
  sequences), vLLM's default token budget on an H100 (8192: ``vllm/engine/arg_utils.py``) and the
  1040-token attention block vLLM ran this model with (docs/models.md).

    python -m hybrid_pd.sizing.matrix fit --out PROFILE.json
    python -m hybrid_pd.sizing.matrix check --profile PROFILE.json [--json OUT.json]   # the table of docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_pd.connector.plan import model_shape
from hybrid_pd.sizing.fitting import fit_decode_step, match_throughput, prompt_latency_residue
from hybrid_pd.sizing.layouts import RUNNER_SYSTEMS
from hybrid_pd.sizing.profile import DecodeStep, Profile, Transfer
from hybrid_pd.sizing.simulate import SLO
from hybrid_pd.sizing.workload import Lengths, Workload

__all__ = ["FITS", "SYSTEMS", "Matrix", "Measured", "fit", "fitted", "load_matrix"]

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
MATRIX = RESULTS / "2026-11-25-h100x2-goodput"
MATRIX_FILES = ("summary-1000.json", "summary-3000-200.json", "summary-phase-split.json")
SWEEP = RESULTS / "2026-11-23-h200x2-real-scale-sweep.json"
BLOCK_TOKENS = 1040  # vLLM's attention block for Nemotron-H-8B (docs/models.md, "Real scale")
TOKEN_BUDGET = 8192  # vLLM's default max_num_batched_tokens for its API server on an H100
FLOOR_CASE, FLOOR_VARIANT = "gpu1-pulls-from-gpu0/zero-copy", "one-descriptor"
# The matrix rows the profile is fitted to and checked against: the replicas and the fixed split.
SYSTEMS = {name: RUNNER_SYSTEMS[name] for name in ("replicas", "pd")}

Key = tuple[str, str, int]  # system, workload, requests in flight (every run of it)
WORKLOADS = ("200/1000", "1000/64", "1000/512", "3000/128")
# profile quantity -> (the metric it is fitted to, the rows whose metric that is)
FITS: dict[str, tuple[str, list[Key]]] = {
    "decode step": ("tpot_mean_ms", [("replicas", w, 1) for w in WORKLOADS] + [("pd", w, c) for w in ("200/1000", "3000/128") for c in (32, 64)]),
    "prefill per token": ("throughput_rps", [("pd", "3000/128", 64)]),
    "prompt latency": ("ttft_p50_ms", [("replicas", w, 1) for w in WORKLOADS]),
    "hand-off": ("ttft_p50_ms", [("pd", w, 1) for w in WORKLOADS]),
}


def fitted(key: Key) -> dict[str, str]:
    """The metrics of a row that a profile quantity was fitted to: metric -> quantity."""
    return {metric: quantity for quantity, (metric, keys) in FITS.items() if key in keys}


@dataclass(frozen=True)
class Measured:
    """One row of the matrix: a system at a workload and level, as ``vllm bench serve`` measured it."""

    run: str  # the summary file it comes from
    system: str
    input_len: int
    output_len: int
    level: int
    prompts: int
    duration_s: float
    throughput_rps: float
    goodput_per_gpu: float  # at the matrix's first SLO pair
    ttft_p50_ms: float
    ttft_mean_ms: float
    tpot_p50_ms: float
    tpot_mean_ms: float

    @property
    def key(self) -> Key:
        return self.system, f"{self.input_len}/{self.output_len}", self.level

    def workload(self) -> Workload:
        """The same traffic: fixed lengths, as many prompts, as many in flight."""
        return Workload(Lengths(self.input_len, self.input_len), Lengths(self.output_len, self.output_len), self.prompts, concurrency=self.level)


@dataclass(frozen=True)
class Matrix:
    rows: list[Measured]  # the replicas and fixed-split rows
    slo: SLO  # the pair their goodput counts
    servers: dict[str, Any]  # the vLLM settings every server ran with

    def of(self, quantity: str) -> list[Measured]:
        """The rows ``quantity`` is fitted from."""
        keys = FITS[quantity][1]
        return [r for r in self.rows if r.key in keys]


def load_matrix(directory: Path = MATRIX, files: tuple[str, ...] = MATRIX_FILES) -> Matrix:
    """The replicas and fixed-split rows of the matrix's summaries."""
    rows, slos, servers = [], set(), set()
    for name in files:
        summary = json.loads((directory / name).read_text())
        slo = summary["slos_ms"][0]
        slos.add(slo)
        servers.add(json.dumps(summary["servers"], sort_keys=True))
        for row in summary["rows"]:
            if row["system"] not in SYSTEMS:
                continue
            s, (i, o) = row["summary"], map(int, row["workload"].split("/"))
            rows.append(Measured(
                Path(name).stem, row["system"], i, o, row["level"], row["prompts"], s["duration_s"], s["request_throughput"],
                s["goodput"][slo]["per_gpu"], s["ttft_ms"]["p50"], s["ttft_ms"]["mean"], s["tpot_ms"]["p50"], s["tpot_ms"]["mean"],
            ))  # fmt: skip
    if len(slos) != 1 or len(servers) != 1:
        raise ValueError(f"the summaries differ in their first SLO pair or their servers: {sorted(slos)}, {sorted(servers)}")
    ttft, tpot = map(float, slos.pop().split("/"))
    return Matrix(rows, SLO(ttft, tpot), json.loads(servers.pop()))


def fit_decode(rows: list[Measured]) -> DecodeStep:
    """The decode step from TPOT against the decoding batch (module docstring), least squares with coefficients >= 0."""
    points = []
    for r in rows:
        batch = 1.0 if r.level == 1 else r.prompts * r.tpot_mean_ms * (r.output_len - 1) / (r.duration_s * 1e3)
        points.append((batch, r.input_len + r.output_len / 2, r.tpot_mean_ms))
    return fit_decode_step(points)


def fit(matrix: Matrix, sweep: dict[str, Any]) -> Profile:
    """The profile the module docstring describes, from the matrix and the H200 sweep's JSON (the model's config, the transfer)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(sweep["config"]))
        shape = model_shape(config)
    lone = sweep["layouts"]["two-gpu"]["1"]
    (floor,) = [r for r in sweep["floor"][FLOOR_CASE]["results"] if r["variant"] == FLOOR_VARIANT and r["in_flight"] == 1]
    floor_ms = floor["nixl_xfer_us_p50"] / 1e3
    transfer = Transfer(latency_ms=lone["vllm_xfer_ms_avg"] - floor_ms, bandwidth_gbps=floor["bytes_per_transfer"] / floor_ms / 1e6)
    draft = Profile(
        model="Nemotron-H-8B (published size, random bf16 weights), vLLM 0.26.0",
        device="NVIDIA H100 80GB",
        source="fitted by python -m hybrid_pd.sizing.matrix fit from the real-scale goodput matrix of 2026-11-25 "
        "(hybrid_pd/bench/results/2026-11-25-h100x2-goodput) and the transfer of 2026-11-23-h200x2-real-scale-sweep.json",
        shape=shape, block_tokens=BLOCK_TOKENS, cache_bytes=int(matrix.servers["kv_cache_gib"] * (1 << 30)),
        max_num_seqs=matrix.servers["max_num_seqs"], max_num_batched_tokens=TOKEN_BUDGET, decode=fit_decode(matrix.of("decode step")),
        prefill_per_token_ms=0.0, prompt_latency_ms=[(0, 0.0)], handoff_ms=0.0, transfer=transfer,
    )  # fmt: skip
    replicas_lone = {(r.run, r.input_len, r.output_len): r.ttft_p50_ms for r in matrix.of("prompt latency")}
    lone: dict[int, list[float]] = {}
    for (_, n, _), ttft in replicas_lone.items():
        lone.setdefault(n, []).append(ttft)

    def with_prefill(per_token: float) -> Profile:
        """The draft with this prefill cost, and the latencies that leave the lone TTFTs as measured."""
        p = draft.model_copy(update={"prefill_per_token_ms": per_token})
        # the split's lone TTFT is the replicas' less one prompt token, plus the hand-off, the transfer and D's one-token step
        handoff = statistics.median(
            r.ttft_p50_ms - replicas_lone[r.run, r.input_len, r.output_len] + per_token - p.transfer_ms(r.input_len) - p.step_ms(0, 0, 1)
            for r in matrix.of("hand-off")
        )
        return p.model_copy(update={"prompt_latency_ms": prompt_latency_residue(p, lone), "handoff_ms": max(handoff, 0.0)})

    (bound,) = matrix.of("prefill per token")
    return match_throughput(with_prefill, SYSTEMS[bound.system], bound.workload(), bound.throughput_rps, high=1.0)


def main(argv: list[str] | None = None) -> int:
    from hybrid_pd.sizing.check import check, markdown

    ap = argparse.ArgumentParser(prog="python -m hybrid_pd.sizing.matrix", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="fit a profile from the matrix and write it")
    f.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="simulate every replicas and pd row of the matrix with a profile; print the table")
    c.add_argument("--profile", type=Path, required=True)
    c.add_argument("--json", type=Path, help="write the comparison here")
    args = ap.parse_args(argv)
    matrix = load_matrix()
    if args.command == "fit":
        fit(matrix, json.loads(SWEEP.read_text())).save(args.out)
        print(f"wrote {args.out}")
        return 0
    compared = check(Profile.load(args.profile), matrix)
    print(markdown(compared, matrix.slo))
    if args.json:
        args.json.write_text(json.dumps({"profile": str(args.profile), "slo_ms": str(matrix.slo), "rows": [x.to_json() for x in compared]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
