"""Router overhead: our router vs vllm-router vs no router, against a fake upstream that costs nothing.

Each path is asked the same requests at each concurrency, one path after the other:

- ``direct``: the client talks to the fake decode server itself (no router, no prefill leg);
- ``hybrid-pd``: our router (``hybrid-pd router``), prefill leg then decode leg;
- ``vllm-router``: vLLM's Rust router (``pip install vllm-router``) in ``--vllm-pd-disaggregation``
  mode, the same two legs.

Both routers use round-robin and log at WARNING (vllm-router logs every request body at INFO).
The upstream (:mod:`hybrid_pd.bench.router.fake_upstream`) answers the prefill leg with
``kv_transfer_params`` and the decode leg with a JSON answer or ``--chunks`` SSE token events at
once, so the routers are the bottleneck. For each case the router's CPU time (user + system of
its process and children, from ``/proc/<pid>/stat``) is divided by the requests it served; the
fake's ``/stats`` confirms every routed request really made both legs.

Runs on demand (not in ``make test``)::

    python -m hybrid_pd.bench.router.overhead                      # -> hybrid_pd/bench/results/router_overhead.json
    python -m hybrid_pd.bench.router.overhead --profile-sse DIR    # py-spy profile of our router, SSE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from hybrid_pd.bench.client import ClientPool, Sampling
from hybrid_pd.bench.prompts import random_prompts
from hybrid_pd.bench.runner import Load, Target, run_level
from hybrid_pd.bench.stats import percentile
from hybrid_pd.common.processes import free_port, spawn, stop_group

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "router_overhead.json"
MODEL = "fake-model"
_TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- processes and their CPU time


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads) and its live descendants, from /proc."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state is fields[0], utime [11], stime [12]
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user
    return (total - idle) / _TICK, total / _TICK


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found += [child, *_descendants(child)]
    return found


@dataclass
class Service:
    """A process this benchmark started, and where it answers."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def _start(name: str, argv: list[str], url: str, log_dir: Path, ready: str = "/health", timeout_s: float = 60) -> Service:
    log = log_dir / f"{name}.log"
    proc = spawn(argv, log=log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + ready, timeout=2) as response:  # noqa: S310 - our own local URL
                if response.status == 200:
                    return Service(name, url, proc, log)
        except OSError:
            pass
        time.sleep(0.2)
    stop_group(proc)
    raise RuntimeError(f"{name} did not answer {url + ready} within {timeout_s:g} s; see {log}")


def start_upstream(log_dir: Path) -> tuple[Service, str, str]:
    """The fake upstream on two ports: (service, prefill URL, decode URL)."""
    prefill, decode = free_port(), free_port()
    argv = [sys.executable, "-m", "hybrid_pd.bench.router.fake_upstream", "--port", str(prefill), "--port", str(decode)]
    service = _start("upstream", argv, f"http://127.0.0.1:{decode}", log_dir)
    return service, f"http://127.0.0.1:{prefill}", service.url


def ours_argv(port: int, prefill: str, decode: str) -> list[str]:
    """Our router as ``hybrid-pd router`` runs it, limits out of the way, round-robin, WARNING logs."""
    return [
        sys.executable, "-m", "hybrid_pd.cli", "--log-level", "WARNING", "router",
        "--host", "127.0.0.1", "--port", str(port), "--prefill", prefill, "--decode", decode,
        "--decode-policy", "round_robin", "--prefill-policy", "round_robin",
        "--max-concurrency", "100000", "--max-concurrency-per-worker", "100000",
    ]  # fmt: skip


def vllm_router_executable() -> str | None:
    local = Path(sys.executable).parent / "vllm-router"
    return str(local) if local.exists() else shutil.which("vllm-router")


def vllm_router_argv(executable: str, port: int, prefill: str, decode: str) -> list[str]:
    return [
        executable, "--vllm-pd-disaggregation", "--policy", "round_robin",
        "--prefill", prefill, "--decode", decode, "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-port", str(free_port()), "--log-level", "warning",
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip


def upstream_stats(upstream: Service) -> dict[str, int]:
    with urllib.request.urlopen(upstream.url + "/stats", timeout=5) as response:  # noqa: S310
        return json.loads(response.read())


# ---------------------------------------------------------------- measuring


@dataclass
class Case:
    """One (mode, concurrency, path): what the client saw and what each process spent."""

    mode: str
    concurrency: int
    path: str
    requests: int
    errors: int
    wall_s: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    router_cpu_ms_per_request: float | None
    upstream_cpu_ms_per_request: float
    client_cpu_ms_per_request: float
    prefill_legs: int
    decode_legs: int
    foreign_cpu_share: float  # of the machine's CPU during the case, what processes outside this run used
    error_samples: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return (self.requests - self.errors) / self.wall_s if self.wall_s else 0.0


async def measure(
    pool: ClientPool,
    path: str,
    url: str,
    router: Service | None,
    upstream: Service,
    mode: str,
    concurrency: int,
    prompts: Sequence[list[int]],
    warmup: Sequence[list[int]],
    chunks: int,
) -> Case:
    """Warm up, then send ``prompts`` at ``concurrency`` through ``url`` and account for every process's CPU."""
    sampling = Sampling(MODEL, chunks, stream=(mode == "sse"))
    target = Target(path, url, MODEL)
    await run_level(pool, target, warmup, sampling, Load("concurrency", concurrency))
    before = upstream_stats(upstream)
    cpu0 = {"router": process_cpu_s(router.pid) if router else 0.0, "upstream": process_cpu_s(upstream.pid)}
    client0, machine0 = time.process_time(), machine_cpu_s()
    run = await run_level(pool, target, prompts, sampling, Load("concurrency", concurrency))
    client_s, machine1 = time.process_time() - client0, machine_cpu_s()
    cpu1 = {"router": process_cpu_s(router.pid) if router else 0.0, "upstream": process_cpu_s(upstream.pid)}
    after = upstream_stats(upstream)
    n = len(run.results)
    ok = [r for r in run.results if r.ok]
    e2e = [r.e2e_s * 1e3 for r in ok]
    ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    decode_key = "decode_stream" if mode == "sse" else "decode_json"
    ours_s = client_s + sum(cpu1.values()) - sum(cpu0.values())
    foreign = max(0.0, (machine1[0] - machine0[0]) - ours_s) / max(machine1[1] - machine0[1], 1e-9)
    return Case(
        mode=mode,
        concurrency=concurrency,
        path=path,
        requests=n,
        errors=n - len(ok),
        wall_s=run.duration_s,
        p50_ms=percentile(e2e, 50),
        p99_ms=percentile(e2e, 99),
        ttft_p50_ms=percentile(ttft, 50) if ttft else None,
        ttft_p99_ms=percentile(ttft, 99) if ttft else None,
        router_cpu_ms_per_request=(cpu1["router"] - cpu0["router"]) * 1e3 / n if router else None,
        upstream_cpu_ms_per_request=(cpu1["upstream"] - cpu0["upstream"]) * 1e3 / n,
        client_cpu_ms_per_request=client_s * 1e3 / n,
        prefill_legs=after.get("prefill", 0) - before.get("prefill", 0),
        decode_legs=after.get(decode_key, 0) - before.get(decode_key, 0),
        foreign_cpu_share=foreign,
        error_samples=sorted({r.error or "" for r in run.results if not r.ok})[:3],
    )


async def run_all(args: argparse.Namespace, paths: dict[str, tuple[str, Service | None]], upstream: Service) -> list[Case]:
    """Every (mode, concurrency), every path in turn; fresh prompts per (mode, concurrency)."""
    cases: list[Case] = []
    seed = 0
    async with ClientPool(httpx.Timeout(120, connect=10)) as pool:
        for mode in args.modes:
            for concurrency in args.concurrency:
                n = args.requests_at_1 if concurrency == 1 else args.requests
                seed += 1
                prompts = random_prompts(n, args.input_len, 256, seed)
                warmup = random_prompts(max(args.warmup, concurrency), args.input_len, 256, 1000 + seed)
                for path, (url, router) in paths.items():
                    case = await measure(pool, path, url, router, upstream, mode, concurrency, prompts, warmup, args.chunks)
                    cases.append(case)
                    print(_row(case), flush=True)
    return cases


# ---------------------------------------------------------------- report


_HEADER = (
    f"{'mode':<5} {'conc':>4} {'path':<28} {'ok':>5} {'err':>4} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'TTFT p50/p99':>14} {'router CPU ms/req':>18} {'upstream':>9} {'client':>7} {'foreign':>7}"
)


def _row(c: Case) -> str:
    ttft = "-" if c.ttft_p50_ms is None else f"{c.ttft_p50_ms:.1f}/{c.ttft_p99_ms:.1f}"
    cpu = "-" if c.router_cpu_ms_per_request is None else f"{c.router_cpu_ms_per_request:.3f}"
    return (
        f"{c.mode:<5} {c.concurrency:>4} {c.path:<28} {c.requests - c.errors:>5} {c.errors:>4} {c.throughput:>7.0f} "
        f"{c.p50_ms:>8.2f} {c.p99_ms:>8.2f} {ttft:>14} {cpu:>18} {c.upstream_cpu_ms_per_request:>9.3f} "
        f"{c.client_cpu_ms_per_request:>7.3f} {c.foreign_cpu_share:>7.0%}"
    )


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("hybrid-pd", "vllm-router", "fastapi", "starlette", "uvicorn", "httpx", "aiohttp", "uvloop", "httptools", "orjson"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _environment() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "cpu_model": next(
            (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
            None,
        ),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
        "versions": _versions(),
    }


# ---------------------------------------------------------------- profiling


def profile_sse(args: argparse.Namespace, prefill: str, decode: str, upstream: Service, log_dir: Path) -> None:
    """``py-spy record`` attached to our router (or a variant) for the measured part of an SSE run.

    Attached after the warm-up, so imports and the first requests stay out of the profile.
    """
    py_spy = Path(sys.executable).parent / "py-spy"
    if not py_spy.exists():
        raise SystemExit("--profile-sse needs py-spy: pip install py-spy")
    out_dir = Path(args.profile_sse)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    router = ours_argv(port, prefill, decode)
    if args.profile_variant:  # an experimental variant (hybrid_pd/bench/router/variants.py)
        router = [sys.executable, "-m", "hybrid_pd.bench.router.variants", args.profile_variant, *router[3:]]
    name = "router_sse" + (f"_{args.profile_variant}" if args.profile_variant else "")
    raw = out_dir / f"{name}.txt"
    service = _start("ours-profiled", router, f"http://127.0.0.1:{port}", log_dir)
    try:
        concurrency = max(args.concurrency)
        case = asyncio.run(_profile_load(args, service, upstream, concurrency, py_spy, raw, log_dir))
        print(_HEADER)
        print(_row(case), flush=True)
    finally:
        stop_group(service.proc, grace_s=5)
    summary = summarize_profile(raw)
    (out_dir / f"{name}.summary.txt").write_text(summary + "\n")
    print(f"py-spy raw (collapsed) stacks: {raw}")
    print(summary)


async def _profile_load(
    args: argparse.Namespace, service: Service, upstream: Service, concurrency: int, py_spy: Path, raw: Path, log_dir: Path
) -> Case:
    async with ClientPool(httpx.Timeout(120, connect=10)) as pool:
        target, sampling = Target("hybrid-pd", service.url, MODEL), Sampling(MODEL, args.chunks)
        await run_level(pool, target, random_prompts(max(args.warmup, concurrency), args.input_len, 256, 98), sampling, Load("concurrency", concurrency))
        argv = [str(py_spy), "record", "--pid", str(service.pid), "--format", "raw", "--rate", "250", "--nonblocking", "-o", str(raw)]
        spy = spawn(argv, log=log_dir / "py-spy.log")
        await asyncio.sleep(2)  # py-spy attaches
        try:
            prompts = random_prompts(args.requests, args.input_len, 256, 99)
            return await measure(pool, "hybrid-pd", service.url, service, upstream, "sse", concurrency, prompts, [], args.chunks)
        finally:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(timeout=60)


def summarize_profile(raw: Path, top: int = 20) -> str:
    """Where a py-spy raw (collapsed stacks) profile spends its samples.

    Three views: self samples by package (the innermost frame's top-level module: where the
    CPU actually runs), self samples by function, and samples whose stack passes through
    each of our router's functions (inclusive). Coroutine stacks start at the frame the event
    loop resumed, so inclusive shares of outer frames are lower bounds. Time inside uvloop's
    C code (socket I/O, callbacks) shows as self time of ``Runner.run``.
    """
    by_package: dict[str, int] = {}
    by_function: dict[str, int] = {}
    ours: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        leaf = frames[-1]
        by_function[leaf] = by_function.get(leaf, 0) + count
        package = _package(leaf)
        by_package[package] = by_package.get(package, 0) + count
        for frame in {f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")" for f in frames if "services/" in f}:
            ours[frame] = ours.get(frame, 0) + count
    if not total:
        return "no samples"

    def table(title: str, counts: dict[str, int], n: int) -> list[str]:
        rows = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
        return ["", title, *(f"{100 * c / total:6.1f}%  {name}" for name, c in rows)]

    return "\n".join(
        [f"{total} samples"]
        + table("self time by package", by_package, top)
        + table("self time by function", by_function, top)
        + table("through our functions (inclusive)", ours, top)
    )


def _package(frame: str) -> str:
    """``f (httpcore/_async/http11.py:289)`` -> ``httpcore``; ``(hybrid_pd/router/app.py:1)`` -> ``hybrid_pd/router``."""
    inside = frame.rpartition(" (")[2]
    path = inside.split(":")[0]
    if path.startswith("<frozen"):
        return "python (importlib/runpy)"
    parts = path.split("/")
    if parts[0] == "hybrid_pd" and len(parts) > 2:
        return "/".join(parts[:2])
    if frame.startswith("Runner.run (asyncio/runners.py"):
        return "event loop (uvloop C code)"
    return parts[0].removesuffix(".py")


# ---------------------------------------------------------------- main


def _shown(value: Any) -> Any:
    """Paths relative to the repository when inside it (the JSON stays the same on every checkout)."""
    if isinstance(value, Path):
        path = value.resolve()
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return value


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_pd.bench.router.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=_ints, default=[1, 64, 256], help="default 1,64,256")
    parser.add_argument("--modes", type=lambda t: t.split(","), default=["json", "sse"], help="json,sse")
    parser.add_argument("--requests", type=int, default=1500, help="measured requests per case (default 1500)")
    parser.add_argument("--requests-at-1", type=int, default=300, help="measured requests at concurrency 1 (default 300)")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured requests per case, at least the concurrency")
    parser.add_argument("--chunks", type=int, default=32, help="output tokens: SSE events per answer (default 32)")
    parser.add_argument("--input-len", type=int, default=512, help="prompt token ids per request (default 512)")
    parser.add_argument(
        "--paths",
        type=lambda t: t.split(","),
        default=["direct", "hybrid-pd", "vllm-router"],
        help="direct,hybrid-pd,vllm-router; 'hybrid-pd[plain+orjson]': our router with experimental "
        "changes (hybrid_pd/bench/router/variants.py)",
    )
    parser.add_argument(
        "--variants-from",
        type=Path,
        metavar="DIR",
        help="start the hybrid-pd[VARIANT] paths from this checkout (another commit: before/after in one run)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--log-dir", type=Path, default=ROOT / ".hybrid-pd" / "bench-logs")
    parser.add_argument("--profile-sse", metavar="DIR", help="instead: profile our router with py-spy under SSE load")
    parser.add_argument("--profile-variant", metavar="V[+V]", help="with --profile-sse: profile this router variant")
    args = parser.parse_args(argv)
    command_line = shlex.join(["python", "-m", "hybrid_pd.bench.router.overhead", *(sys.argv[1:] if argv is None else argv)])
    args.log_dir.mkdir(parents=True, exist_ok=True)

    started: list[Service] = []
    try:
        upstream, prefill, decode = start_upstream(args.log_dir)
        started.append(upstream)
        if args.profile_sse:
            profile_sse(args, prefill, decode, upstream, args.log_dir)
            return 0
        paths: dict[str, tuple[str, Service | None]] = {}
        notes: list[str] = []
        for path in args.paths:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            if path == "direct":
                paths[path] = (decode, None)
            elif path == "hybrid-pd" or path.startswith("hybrid-pd["):
                command = ours_argv(port, prefill, decode)
                if path != "hybrid-pd":  # an experimental variant (hybrid_pd/bench/router/variants.py)
                    command = [sys.executable, "-m", "hybrid_pd.bench.router.variants", path[len("hybrid-pd[") : -1], *command[3:]]
                    if args.variants_from:  # `python -m` imports from the working directory: that checkout's code
                        command = ["sh", "-c", 'cd "$0" && exec "$@"', str(args.variants_from.resolve()), *command]
                service = _start(path, command, url, args.log_dir)
                started.append(service)
                paths[path] = (url, service)
            elif path == "vllm-router":
                executable = vllm_router_executable()
                if executable is None:
                    notes.append("vllm-router is not installed (pip install vllm-router): skipped")
                    print(notes[-1], file=sys.stderr)
                    continue
                service = _start(path, vllm_router_argv(executable, port, prefill, decode), url, args.log_dir)
                started.append(service)
                paths[path] = (url, service)
            else:
                parser.error(f"unknown path {path!r}")
        environment = _environment()
        print(_HEADER, flush=True)
        began = time.monotonic()
        cases = asyncio.run(run_all(args, paths, upstream))
        environment["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
        environment["wall_s"] = round(time.monotonic() - began, 1)
    finally:
        for service in reversed(started):
            stop_group(service.proc, grace_s=5)

    direct = {(c.mode, c.concurrency): c for c in cases if c.path == "direct"}
    results = []
    for c in cases:
        entry = asdict(c) | {"throughput_rps": round(c.throughput, 1)}
        base = direct.get((c.mode, c.concurrency))
        if base is not None and c.path != "direct":
            entry["added_p50_ms"] = round(c.p50_ms - base.p50_ms, 3)
            entry["added_p99_ms"] = round(c.p99_ms - base.p99_ms, 3)
        results.append({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})
    report = {
        "command": command_line.strip(),
        "config": {k: _shown(v) for k, v in vars(args).items() if not k.startswith("profile")},
        "environment": environment,
        "notes": notes,
        "cases": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    bad = [c for c in cases if c.errors or (c.path != "direct" and (c.prefill_legs != c.requests or c.decode_legs != c.requests))]
    for c in bad:
        print(f"WARNING {c.mode} c={c.concurrency} {c.path}: {c.errors} errors {c.error_samples}, "
              f"{c.prefill_legs} prefill / {c.decode_legs} decode legs for {c.requests} requests", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
