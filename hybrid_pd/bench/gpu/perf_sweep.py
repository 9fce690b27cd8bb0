"""GPU load sweep: P/D against colocated, on one GPU and across two, plus the NIXL floor of the same state.

Run on a machine with one or two NVIDIA GPUs and vLLM + NIXL installed:

    python3 -m hybrid_pd.bench.gpu.perf_sweep --out results/ [--layouts one-gpu,two-gpu] [--levels 1,8,32,64] [--model DIR]

Starts through ``hybrid-pd``, with the random-weight hybrid of ``pd_check.py`` or ``--model``
(real scale: ``python -m hybrid_pd.models.families DIR --full nemotron_h`` builds Nemotron-H-8B):

- ``one-gpu``: prefill, decode and a colocated server on GPU 0; P/D through one
  router, the colocated server through another (both paths pay a router);
- ``two-gpu``: the same prefill (GPU 0) with a decode worker on GPU 1, against two
  colocated replicas (GPU 0 and GPU 1) behind one router: the same two GPUs either
  split by phase or as data-parallel replicas.

Prefill and decode workers record the NIXL transfers they post
(``--nixl-trace-dir``). Per layout: a discarded warm-up level, then ``hybrid-pd
bench`` at each level (P/D and baseline interleaved, same prompts), with the decode
workers' own transfer figures for that level (``vllm:nixl_xfer_time_seconds``,
post time, bytes, descriptors). Then every server stops and
``hybrid_pd/bench/nixl_floor.py`` replays the traced transfers with NIXL alone, at 1 and
at the largest level in flight: on GPU 0, polling completion without pause and every
1 ms (and GPU 1 pulling from GPU 0 with two GPUs, each side seeing both GPUs or only
its own, as the workers do), with our UCX rule (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``)
and with UCX's defaults.
Writes ``summary.json``, each level's bench JSON and the servers' logs to ``--out``, and
``sweep-<layout>.png`` when matplotlib is installed (``--plot-from summary.json`` redraws them).

``--variant NAME:ROLE=FLAG,FLAG``: before/after in one run (one-gpu). A variant gets a router of
its own, with these extra flags where ``NAME:router=...`` is given; a decode worker of its own on
GPU 0 with these extra worker flags where ``NAME:decode=...`` is (else it shares the decode
worker), and likewise a prefill worker (``NAME:prefill=...``); at every level it is benched
against the unchanged P/D (same prompts, interleaved), after the P/D-vs-colocated bench, with
``--timeline`` budgets of both. Issue #35's early decode legs against the legs one after the
other: ``--variant sequential:router=--no-early-decode``. Issue #12's cuts were measured so:

    python3 -m hybrid_pd.bench.gpu.perf_sweep --out results/ --layouts one-gpu --levels 1,32 --timeline \
        --variant await:decode=--pull-await-us=1000 --variant sync:decode=--vllm-arg=--no-async-scheduling

``--input-len 1000,8000``: each prompt length in turn on the same servers (``--max-model-len`` must
hold the longest); the summary keeps each length's sweep under ``sweeps``.

``--timeline``: the P/D routers and workers also record the hand-off timeline into
``<out>/timeline`` (``--timeline-dir``), and each level's bench prints and keeps its budget
(``hybrid-pd bench --timeline``): where P/D's TTFT goes, segment by segment, p50/p90/mean,
in ``summary.json`` under each level's ``timeline``. The "before" table of issue #12 is

    python3 -m hybrid_pd.bench.gpu.perf_sweep --out results/ --layouts one-gpu --levels 1,32 --timeline
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

from hybrid_pd.bench.gpu.pd_check import cli, gpu_model, metrics_of, wait_all_ready
from hybrid_pd.bench.plot import PlotUnavailable, plot_series
from hybrid_pd.bench.stats import Distribution
from hybrid_pd.common.processes import free_port, spawn, stop_group
from hybrid_pd.default_model import ensure_default_model

NAME = "hybrid-gpu"
SLO_TTFT_MS, SLO_ITL_MS = "500", "20"
DECODE_METRICS = {
    "transfers": "vllm:nixl_xfer_time_seconds_count",
    "xfer_s": "vllm:nixl_xfer_time_seconds_sum",
    "post_s": "vllm:nixl_post_time_seconds_sum",
    "bytes": "vllm:nixl_bytes_transferred_sum",
    "descriptors": "vllm:nixl_num_descriptors_sum",
}
ZERO_COPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


# server -> (role, GPU); layout -> router name -> (prefill servers, decode servers)
SERVERS = {"prefill": ("prefill", 0), "decode0": ("decode", 0), "colocated0": ("colocated", 0), "decode1": ("decode", 1), "colocated1": ("colocated", 1)}
LAYOUTS = {
    "one-gpu": {"one-gpu": (["prefill"], ["decode0"]), "one-gpu-baseline": ([], ["colocated0"])},
    "two-gpu": {"two-gpu": (["prefill"], ["decode1"]), "two-gpu-baseline": ([], ["colocated0", "colocated1"])},
}


@dataclass(frozen=True)
class Variant:
    """A P/D pair changed by extra worker or router flags, measured against the unchanged one (``--variant``)."""

    name: str
    decode_flags: tuple[str, ...] | None  # None: shares the unchanged decode worker
    prefill_flags: tuple[str, ...] | None  # None: shares the unchanged prefill
    router_flags: tuple[str, ...] = ()

    @property
    def servers(self) -> dict[str, tuple[str, int, tuple[str, ...]]]:
        """{server name: (role, GPU, extra flags)} this variant adds."""
        added = {}
        if self.decode_flags is not None:
            added[f"decode0-{self.name}"] = ("decode", 0, self.decode_flags)
        if self.prefill_flags is not None:
            added[f"prefill-{self.name}"] = ("prefill", 0, self.prefill_flags)
        return added

    @property
    def legs(self) -> tuple[list[str], list[str]]:
        """(prefill names, decode names) behind the variant's router."""
        return ([f"prefill-{self.name}" if self.prefill_flags is not None else "prefill"],
                [f"decode0-{self.name}" if self.decode_flags is not None else "decode0"])  # fmt: skip


VARIANT_ROLES = ("decode", "prefill", "router")


def parse_variants(texts: list[str]) -> list[Variant]:
    """``NAME:decode=FLAG,FLAG``, ``NAME:prefill=...`` and ``NAME:router=...`` entries, one Variant per name (each needs its
    decode or its router entry: a variant that changed neither would measure the unchanged pair against itself)."""
    flags: dict[str, dict[str, tuple[str, ...]]] = {}
    for text in texts:
        key, sep, value = text.partition("=")
        name, _, role = key.partition(":")
        if not sep or not name or role not in VARIANT_ROLES or role in flags.get(name, {}):
            raise ValueError(f"--variant {text!r}: want NAME:decode=FLAG[,FLAG...], NAME:prefill=... or NAME:router=..., each once per name")
        flags.setdefault(name, {})[role] = tuple(f for f in value.split(",") if f)
    missing = [name for name, roles in flags.items() if "decode" not in roles and "router" not in roles]
    if missing:
        raise ValueError(f"--variant {missing[0]}: every variant needs NAME:decode=... (its own decode worker) or NAME:router=...")
    return [Variant(name, roles.get("decode"), roles.get("prefill"), roles.get("router", ())) for name, roles in flags.items()]


def _servers(
    args: argparse.Namespace, layouts: list[str], model_dir: Path, timeline: Path | None, variants: list[Variant] = ()
) -> tuple[dict[str, dict], dict[str, tuple]]:
    """{name: {gpu, argv, url}} of the vLLM servers the layouts (and one-gpu variants) use and {router name: (prefill names, decode names)}; ``timeline``: P/D workers record there."""
    common = ["--model", str(model_dir), "--served-model-name", NAME, "--device", args.device, "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", "64"]  # fmt: skip
    if args.device == "cuda":
        common += ["--gpu-memory-utilization", str(args.gpu_memory_utilization), "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    routers = {name: legs for layout in layouts for name, legs in LAYOUTS[layout].items()}
    known = {name: (role, gpu, ()) for name, (role, gpu) in SERVERS.items()}
    for variant in variants if "one-gpu" in layouts else ():
        known |= variant.servers
        routers[f"one-gpu-{variant.name}"] = variant.legs
    wanted = dict.fromkeys(name for prefills, decodes in routers.values() for name in (*prefills, *decodes))
    servers = {}
    for name in wanted:
        role, gpu, extra = known[name]
        port = free_port()
        argv = cli(role, *common, "--port", str(port), *extra)
        if role != "colocated":
            argv += ["--side-channel-port", str(free_port()), "--nixl-trace-dir", str(args.out / "trace")]
            argv += ["--timeline-dir", str(timeline)] if timeline else []
        servers[name] = {"gpu": gpu, "argv": argv, "url": f"http://127.0.0.1:{port}"}
    return servers, routers


def _decode_figures(urls: list[str]) -> dict[str, float]:
    return {key: sum(metrics_of(url, name) for url in urls) for key, name in DECODE_METRICS.items()}


def _bench(
    args: argparse.Namespace, input_len: int, endpoint: str, baseline: str, level: int, prompts: int, seed: int, out: Path | None,
    timeline: Path | None = None,
) -> int:
    argv = cli("bench", "--endpoint", endpoint, "--baseline", baseline, "--concurrency", str(level),
               "--input-len", str(input_len), "--output-len", str(args.output_len), "--num-prompts", str(prompts),
               "--slo-ttft-ms", SLO_TTFT_MS, "--slo-itl-ms", SLO_ITL_MS, "--seed", str(seed), "--warmup", "0")  # fmt: skip
    if out is not None:
        argv += ["--json", str(out)]
    if timeline is not None:
        argv += ["--timeline", str(timeline)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    print(run.stdout[-6000:], run.stderr[-1500:], flush=True)
    return run.returncode


def _level_summary(report_path: Path, figures: dict[str, float]) -> dict:
    report = json.loads(report_path.read_text())
    level = report["levels"][0]
    pick = ("request_throughput", "output_throughput", "goodput", "errors", "ttft_ms", "itl_ms", "e2e_ms")
    n = max(figures["transfers"], 1)
    return {
        "pd": {k: level["endpoint"][k] for k in pick},
        "baseline": {k: level["baseline"][k] for k in pick},
        "ttft_p50_ratio": round(level["endpoint"]["ttft_ms"]["p50"] / level["baseline"]["ttft_ms"]["p50"], 3),
        "vllm_transfers": figures["transfers"],
        "vllm_xfer_ms_avg": round(figures["xfer_s"] / n * 1e3, 3),
        "vllm_post_ms_avg": round(figures["post_s"] / n * 1e3, 3),
        "bytes_per_transfer": round(figures["bytes"] / n),
        "descriptors_per_transfer": round(figures["descriptors"] / n, 1),
        **_timeline_summary(report),
    }


def _timeline_summary(report: dict) -> dict:
    """The level's hand-off budget (``hybrid-pd bench --timeline``) without its per-request rows (those stay in the level's JSON)."""
    if "timeline" not in report:
        return {}
    def without_rows(level: dict) -> dict:
        return {k: v for k, v in level.items() if k != "per_request"}

    out = {"timeline": without_rows(report["timeline"]["levels"][0])}
    if report["timeline"].get("baseline_levels"):  # a variant's bench: the unchanged P/D's budget beside
        out["baseline_timeline"] = without_rows(report["timeline"]["baseline_levels"][0])
    return out


def _floor(trace: Path, out: Path, in_flight: str, case: tuple[str, int, int, bool, int], zero_copy: bool) -> dict:
    _name, initiator, target, isolate, poll_us = case
    env = {k: v for k, v in os.environ.items() if k != ZERO_COPY}
    if zero_copy:
        env[ZERO_COPY] = "y"
    argv = [sys.executable, "-m", "hybrid_pd.bench.nixl_floor", "--trace", str(trace), "--in-flight", in_flight,
            "--initiator-device", str(initiator), "--target-device", str(target), "--poll-interval-us", str(poll_us),
            "--json", str(out)]  # fmt: skip
    if isolate:
        argv.append("--isolate-devices")
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    print(run.stdout[-2500:], run.stderr[-1500:] if run.returncode else "", flush=True)
    return json.loads(out.read_text()) if run.returncode == 0 else {"exit_code": run.returncode, "stderr": run.stderr[-1500:]}


@dataclass(frozen=True)
class _Latencies:
    ttft: Distribution
    itl: Distribution
    e2e: Distribution


def plot_summary(summary: dict, out: Path) -> list[Path]:
    """``sweep-<layout>.png`` per layout: TTFT, ITL and E2E (p50, p99) against concurrency, P/D and baseline."""
    def dist(d: dict) -> Distribution:
        return Distribution(count=d["count"], mean=d["mean"] / 1e3, p50=d["p50"] / 1e3, p90=d["p90"] / 1e3, p99=d["p99"] / 1e3)

    written = []
    sweeps = summary.get("sweeps") or {str(summary["input_len"]): summary}  # a run of one prompt length before there were several
    for input_len, sweep in sweeps.items():
        for layout, levels in sweep["layouts"].items():
            series = {
                label: [(float(c), _Latencies(*(dist(r[key][f]) for f in ("ttft_ms", "itl_ms", "e2e_ms")))) for c, r in levels.items()]
                for key, label in (("pd", "P/D"), ("baseline", "colocated" if layout == "one-gpu" else "2 colocated"))
            }
            path = out / (f"sweep-{layout}.png" if len(sweeps) == 1 else f"sweep-{layout}-{input_len}.png")
            plot_series(series, "concurrency", f"{layout}: {input_len} in / {summary['output_len']} out tokens", path)
            written.append(path)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layouts", default="one-gpu,two-gpu", help="one-gpu and/or two-gpu (needs 2 GPUs)")
    ap.add_argument("--levels", default="1,8,32,64", help="concurrency levels")
    ap.add_argument("--prompts-per-request-in-flight", type=int, default=4, help="prompts per level = this x level (at least 32)")
    ap.add_argument("--input-len", type=lambda s: [int(x) for x in s.split(",")], default=[1000], help="prompt tokens, or several in turn (1000,8000)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="per server; above the longest prompt and its output")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--plot-from", type=Path, metavar="SUMMARY", help="only draw the plots of an earlier run's summary.json into --out")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run with the embedded model")
    ap.add_argument("--timeline", action="store_true", help="record the hand-off timeline and keep each level's budget (P/D layouts)")
    ap.add_argument("--no-floor", action="store_true", help="skip the NIXL floor replay after the servers stop")
    ap.add_argument("--model", type=Path, help="checkpoint to serve (default: pd_check.py's random-weight hybrid)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2, help="per server; raise it for an 8B model (its weights must fit)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:ROLE=FLAGS",
                    help="one-gpu: a P/D pair with these extra worker flags, benched against the unchanged one (repeatable; see above)")
    ap.add_argument("--kv-cache-gib", type=float, default=8, help="per server: attention KV and Mamba state (8B Nemotron-H: ~100 MB of state per sequence)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_from:
        print(*plot_summary(json.loads(args.plot_from.read_text()), args.out), sep="\n")
        return 0
    layouts = args.layouts.split(",")
    levels = [int(x) for x in args.levels.split(",")]
    model_dir = args.model or (gpu_model() if args.device == "cuda" else ensure_default_model())
    timeline = args.out / "timeline" if args.timeline else None
    variants = parse_variants(args.variant) if "one-gpu" in layouts else []
    servers, routers = _servers(args, layouts, model_dir, timeline, variants)
    procs, urls = {}, {}
    started = time.monotonic()
    for name, server in servers.items():
        procs[name] = spawn(server["argv"], env={"CUDA_VISIBLE_DEVICES": str(server["gpu"])}, log=args.out / f"{name}.log")
        urls[name] = server["url"]
    router_flags = {f"one-gpu-{v.name}": list(v.router_flags) for v in variants}
    for name, (prefills, decodes) in routers.items():
        port = free_port()
        argv = cli("router", "--port", str(port), *router_flags.get(name, []))
        argv += ["--timeline-dir", str(timeline)] if timeline and prefills else []  # the P/D routers, not the baselines'
        argv += [a for p in prefills for a in ("--prefill", urls[p])] + [a for d in decodes for a in ("--decode", urls[d])]
        procs[name] = spawn(argv, log=args.out / f"router-{name}.log")
        urls[name] = f"http://127.0.0.1:{port}"
    summary: dict = {"sweeps": {}, "levels": levels, "input_len": args.input_len, "output_len": args.output_len, "timeline": args.timeline,
                     "model": str(model_dir), "config": json.loads((model_dir / "config.json").read_text())}  # fmt: skip
    try:
        summary["ready_s"] = wait_all_ready(procs, urls, args.out, started, timeout_s=600)
        for input_len in args.input_len:
            sweep = summary["sweeps"][str(input_len)] = {"layouts": {}, "variants": {}}
            for layout in layouts:
                decode_urls = [urls[d] for d in routers[layout][1]]
                endpoint, baseline = urls[layout], urls[f"{layout}-baseline"]
                # (name, router, baseline router, decode servers): P/D against colocated, then each variant against P/D
                runs = [(layout, endpoint, baseline, decode_urls)]
                if layout == "one-gpu":
                    runs += [(f"{layout}-{v.name}", urls[f"{layout}-{v.name}"], endpoint, [urls[d] for d in v.legs[1]]) for v in variants]
                for _, router, against, _ in runs:
                    _bench(args, input_len, router, against, max(levels), 2 * max(levels), seed=1000, out=None)  # warm-up, discarded
                results: dict[str, dict] = {name: {} for name, *_ in runs}
                for level in levels:
                    for name, router, against, decodes in runs:
                        before = _decode_figures(decodes)
                        report = args.out / f"{name}-{input_len}-c{level}.json"
                        prompts = max(32, args.prompts_per_request_in_flight * level)
                        code = _bench(args, input_len, router, against, level, prompts, level, report, timeline)
                        time.sleep(11)  # vLLM publishes NIXL stats once per logging interval
                        after = _decode_figures(decodes)
                        results[name][level] = {"bench_exit_code": code, **_level_summary(report, {k: after[k] - before[k] for k in after})}
                        print(name, input_len, level, json.dumps({k: v for k, v in results[name][level].items() if k not in ("pd", "baseline")}), flush=True)
                sweep["layouts"][layout] = results.pop(layout)
                sweep["variants"] |= {name.removeprefix(f"{layout}-"): r for name, r in results.items()}
    finally:
        for proc in procs.values():
            stop_group(proc, grace_s=10)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))

    if args.no_floor:
        return 0
    in_flight = f"1,{max(levels)}"
    # (name, initiator GPU, target GPU, each side sees only its GPU as the workers do, completion polled every N us)
    cases = [("same-gpu", 0, 0, False, 0), ("same-gpu-polled-1ms", 0, 0, False, 1000)]
    if "two-gpu" in layouts:
        cases += [("gpu1-pulls-from-gpu0", 1, 0, False, 0), ("gpu1-pulls-from-gpu0-isolated", 1, 0, True, 0)]
    summary["floor"] = {
        f"{case[0]}/{'zero-copy' if zc else 'ucx-default'}": _floor(
            args.out / "trace", args.out / f"floor-{case[0]}-{'zcopy' if zc else 'default'}.json", in_flight, case, zc
        )
        for case in cases
        for zc in (True, False)
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "layouts"}, indent=1)[:6000], flush=True)
    try:
        plot_summary(summary, args.out)
    except PlotUnavailable as exc:
        print(exc, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
