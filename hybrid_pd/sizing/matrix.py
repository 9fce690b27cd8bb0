"""A profile fitted from the real-scale goodput matrix, and the simulator's predictions checked against that matrix.

The matrix (docs/performance.md: Nemotron-H-8B, two H100s, vLLM 0.26.0, ``vllm bench serve``)
measured, per workload and requests in flight, colocated replicas (``replicas``) and a fixed
1 prefill + 1 decode split (``pd``) on the same two GPUs. No profile was measured on its own,
so :func:`fit` takes each profile quantity from the rows that show it most directly and names
them (:data:`FITS`); every other figure of every row is a prediction (:func:`check`, a figure fitted to marked):

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

The four-H100 run (``2026-11-27-h100x4-planner``: replicas, 1P3D and 3P1D on four GPUs, 2 prompts
per request in flight, 14 GiB caches) refits what the two-GPU matrix could not show, each from the
rows that show it (:data:`FOUR_FITS`), over a profile fitted as above (:func:`refit`):

- **prefill per token**: 1P3D's throughput at 16000/256 @ 32, where its one prefill GPU is the
  bottleneck (the two-GPU fit came from 3000-token prompts and 3 in a step);
- **prefill per prompt**: the replicas' TTFT mean at 1000/512 @ 128, four steps of eight
  1000-token prompts at each wave; the short prompts' latencies are lowered by what their lone
  steps gained, so the lone TTFTs stay as measured;
- **prompt latency of long prompts**: the replicas' TTFT mean at 16000/256 @ 32 and 32000/128 @ 16,
  each its own point of the table (nothing below 3000 tokens was measured lone): a replacement
  request that reaches the engine later lets the requests just ahead of it finish first.

    python -m hybrid_pd.sizing.matrix refit --base PROFILE.json --out REFIT.json   # prints the comparison
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybrid_pd.connector.plan import model_shape
from hybrid_pd.sizing.fitting import bisect_root, engine_prefill_ms, fit_decode_step, match_throughput, prompt_latency_residue
from hybrid_pd.sizing.layouts import RUNNER_SYSTEMS, Layout
from hybrid_pd.sizing.profile import DecodeStep, Profile, Transfer
from hybrid_pd.sizing.simulate import SLO, Prediction, predict
from hybrid_pd.sizing.workload import Lengths, Workload

__all__ = [
    "FITS",
    "FOUR_FITS",
    "METRICS",
    "SYSTEMS",
    "Compared",
    "FourRow",
    "Matrix",
    "Measured",
    "check",
    "fit",
    "fitted",
    "four_table",
    "load_four",
    "load_matrix",
    "markdown",
    "refit",
]

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
            r.ttft_p50_ms - replicas_lone[r.run, r.input_len, r.output_len] + per_token - p.transfer_ms(r.input_len) - p.step_ms(0, 0, 1, 1)
            for r in matrix.of("hand-off")
        )
        return p.model_copy(update={"prompt_latency_ms": prompt_latency_residue(p, lone), "handoff_ms": max(handoff, 0.0)})

    (bound,) = matrix.of("prefill per token")
    return match_throughput(with_prefill, SYSTEMS[bound.system], bound.workload(), bound.throughput_rps, high=1.0)


FOUR_GPU = RESULTS / "2026-11-27-h100x4-planner"
FOUR_KV_CACHE_BYTES = 14 << 30  # the four-GPU run's --kv-cache-gib 14 (its summary's servers)
# The four-GPU systems, as the simulator lays them out, and the run's points: (input, output, in flight, SLO).
FOUR_SYSTEMS = {"replicas": Layout("replicas", 0, 4), "1P3D": Layout("pd", 1, 3), "3P1D": Layout("pd", 3, 1)}
FOUR_POINTS = ((1000, 512, 64, SLO(500, 20)), (1000, 512, 128, SLO(500, 20)), (16000, 256, 32, SLO(4000, 15)), (32000, 128, 16, SLO(4000, 15)))
FourKey = tuple[str, int, int, int]  # system, input, output, in flight
FOUR_FITS: dict[str, tuple[str, list[FourKey]]] = {
    "prefill per token": ("throughput_rps", [("1P3D", 16000, 256, 32)]),
    "prefill per prompt": ("ttft_mean_ms", [("replicas", 1000, 512, 128)]),
    "prompt latency": ("ttft_mean_ms", [("replicas", 16000, 256, 32), ("replicas", 32000, 128, 16)]),
}


@dataclass(frozen=True)
class FourRow:
    """One system at one point of the four-GPU run, as ``vllm bench serve`` measured it."""

    system: str
    workload: Workload  # the same traffic: fixed lengths, as many prompts, as many in flight
    slo: SLO
    throughput_rps: float
    goodput_per_gpu: float  # at the point's SLO pair
    ttft_mean_ms: float
    tpot_mean_ms: float

    @property
    def key(self) -> FourKey:
        w = self.workload
        return self.system, w.input_len.low, w.output_len.low, w.concurrency or 0


def load_four(directory: Path = FOUR_GPU) -> list[FourRow]:
    """The replicas, 1P3D and 3P1D rows of the four-GPU run's matrix."""
    rows = []
    for i, o, c, slo in FOUR_POINTS:
        for system in FOUR_SYSTEMS:
            row = json.loads((directory / "rows" / f"{system}-{i}x{o}-c{c}-slo{slo.ttft_ms:g}-{slo.tpot_ms:g}.row.json").read_text())
            s = row["summary"]
            workload = Workload(Lengths(i, i), Lengths(o, o), row["prompts"], concurrency=c)
            rows.append(FourRow(system, workload, slo, s["request_throughput"], s["target"]["per_gpu"], s["ttft_ms"]["mean"], s["tpot_ms"]["mean"]))
    return rows


def refit(base: Profile, rows: list[FourRow]) -> Profile:
    """``base`` with the four-GPU run's cache and the quantities of :data:`FOUR_FITS`, in that order (module docstring)."""
    of = {r.key: r for r in rows}
    lone = [n for n, _ in base.prompt_latency_ms]
    ttft = lambda p, key: predict(p, FOUR_SYSTEMS[key[0]], of[key].workload, of[key].slo).ttft_mean_ms  # noqa: E731

    def costs(per_token: float, per_prompt: float) -> Profile:
        """``base`` at these prefill costs, its latencies lowered by what the lone prompts' steps gained (lone TTFTs kept)."""
        p = base.model_copy(update={"cache_bytes": FOUR_KV_CACHE_BYTES, "prefill_per_token_ms": per_token, "prefill_per_prompt_ms": per_prompt})
        table = [(n, max(ms + engine_prefill_ms(base, n) - engine_prefill_ms(p, n), 0.0)) for n, ms in base.prompt_latency_ms]
        return p.model_copy(update={"prompt_latency_ms": table})

    ((bound, *_),) = [FOUR_FITS["prefill per token"][1]]
    p = match_throughput(lambda x: costs(x, 0.0), FOUR_SYSTEMS[bound[0]], of[bound].workload, of[bound].throughput_rps, high=1.0)
    (waves,) = FOUR_FITS["prefill per prompt"][1]
    per_token = p.prefill_per_token_ms
    p = costs(per_token, bisect_root(lambda x: ttft(costs(per_token, x), waves) - of[waves].ttft_mean_ms, 0.0, 50.0))
    for key in FOUR_FITS["prompt latency"][1]:
        n = key[1]
        if n <= lone[-1]:
            raise ValueError(f"{n} tokens is within the lone prompts' table: its latency is fitted there")
        at = lambda ms: p.model_copy(update={"prompt_latency_ms": [*p.prompt_latency_ms, (n, ms)]})  # noqa: E731
        p = at(bisect_root(lambda ms: ttft(at(ms), key) - of[key].ttft_mean_ms, 0.0, 2000.0))
    source = (f"{base.source}; refitted by python -m hybrid_pd.sizing.matrix refit from the four-H100 run of 2026-11-27 "
              "(hybrid_pd/bench/results/2026-11-27-h100x4-planner): prefill per token and per prompt, long prompts' latency, 14 GiB cache")
    return p.model_copy(update={"source": source})


def four_table(profile: Profile, rows: list[FourRow]) -> str:
    """Predicted / measured goodput per GPU (and TTFT, TPOT means) of every four-GPU row; a figure fitted to is starred."""
    fitted_to = {key: metric for metric, keys in FOUR_FITS.values() for key in keys}
    lines = ["| point | system | goodput /GPU predicted / measured | error | TTFT mean ms | TPOT mean ms | req/s |", "|" + "---|" * 7]
    for r in rows:
        p = predict(profile, FOUR_SYSTEMS[r.system], r.workload, r.slo)
        w, mark = r.workload, lambda m: "*" if fitted_to.get(r.key) == m else ""  # noqa: E731
        lines.append(
            f"| {w.input_len}/{w.output_len} @ {w.concurrency}, {r.slo} | {r.system} | {p.goodput_per_gpu:.2f} / {r.goodput_per_gpu:.2f} | "
            f"{(p.goodput_per_gpu - r.goodput_per_gpu) / r.goodput_per_gpu:+.0%} | {mark('ttft_mean_ms')}{p.ttft_mean_ms:.0f} / {r.ttft_mean_ms:.0f} | "
            f"{p.tpot_mean_ms:.1f} / {r.tpot_mean_ms:.1f} | {mark('throughput_rps')}{p.throughput_rps:.2f} / {r.throughput_rps:.2f} |"
        )
    return "\n".join(lines)


# --- the simulator's predictions against the matrix, row by row (``check``) ---

METRICS = ("throughput_rps", "goodput_per_gpu", "ttft_p50_ms", "tpot_p50_ms", "tpot_mean_ms")


@dataclass(frozen=True)
class Compared:
    measured: Measured
    predicted: Prediction
    fitted: dict[str, str]  # metric -> the profile quantity fitted to it

    def error(self, metric: str) -> float | None:
        """(predicted - measured) / measured; None where nothing was measured."""
        m = getattr(self.measured, metric)
        return None if m == 0 else (getattr(self.predicted, metric) - m) / m

    def to_json(self) -> dict[str, Any]:
        return {"measured": asdict(self.measured), "predicted": self.predicted.to_json(), "fitted": self.fitted,
                "error": {m: self.error(m) for m in METRICS}}  # fmt: skip


def check(profile: Profile, matrix: Matrix) -> list[Compared]:
    return [Compared(r, predict(profile, SYSTEMS[r.system], r.workload(), matrix.slo), fitted(r.key)) for r in matrix.rows]


def markdown(compared: list[Compared], slo: SLO) -> str:
    """The comparison as a table, measured → predicted (error) per figure; a fitted figure in italics."""
    head = ["workload", "in flight", "system", "run", "req/s", f"goodput {slo} /GPU", "TTFT p50 ms", "TPOT p50 ms", "TPOT mean ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in sorted(compared, key=lambda c: (c.measured.input_len, c.measured.output_len, c.measured.level, c.measured.system, c.measured.run)):
        m = c.measured
        cells = [f"{m.input_len}/{m.output_len}", str(m.level), m.system, m.run.removeprefix("summary-")]
        for metric in METRICS:
            err = c.error(metric)
            text = f"{getattr(m, metric):.2f} → {getattr(c.predicted, metric):.2f} ({'n/a' if err is None else f'{err:+.0%}'})"
            cells.append(f"*{text}*" if metric in c.fitted else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_pd.sizing.matrix", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="fit a profile from the matrix and write it")
    f.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="simulate every replicas and pd row of the matrix with a profile; print the table")
    c.add_argument("--profile", type=Path, required=True)
    c.add_argument("--json", type=Path, help="write the comparison here")
    r = sub.add_parser("refit", help="refit a profile to the four-H100 run (module docstring), write it and print the comparison")
    r.add_argument("--base", type=Path, required=True, help="a profile fitted from the two-GPU matrix (fit)")
    r.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.command == "refit":
        rows = load_four()
        profile = refit(Profile.load(args.base), rows)
        profile.save(args.out)
        print(f"wrote {args.out}\n{four_table(profile, rows)}")
        return 0
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
