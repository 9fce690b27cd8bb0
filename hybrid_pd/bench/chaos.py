"""Chaos: P/D under load while workers crash and come back, every answer checked against a colocated server.

    python -m hybrid_pd.bench.chaos --prefill 2 --decode 2 --requests 500 --concurrency 32 --json chaos.json

Starts a stack on this machine (``hybrid_pd.stack.Stack``: the workers, the router and a
colocated vLLM server as the reference), asks the colocated server for the greedy answer to
each prompt, then sends the requests through the router (every other one streamed) while a
crash loop kills a random worker's vLLM (SIGKILL of its process group: a crash, not a stop)
once a quarter of the requests are answered, then every ``--crash-every-s``, and restarts it (the
first crash follows the load's progress, not the clock, so a fast stack still crashes under load).
One decode worker is always left up. Prints a
table and writes JSON:

- ``correct``: the colocated tokens; ``wrong``: other tokens with HTTP 200 (must be 0);
- ``clean_error``: an OpenAI error answer, or an error event ending a stream;
  ``unclean``: anything else (a dropped connection, a stream without ``[DONE]``; must be 0), and
  ``unclean_why`` what each looked like;
- ``migrated``, ``retried``, ``fallbacks``: what the router did (its metrics);
- ``crashes`` and ``prefill_kv_held``: prefill workers still holding state once their KV lease
  has run out after the load (must be 0).

Loopback only, bounded in count (``--requests``, each with a 300 s timeout). The end-to-end
suite runs a short version on its own stack (tests/e2e/test_router_resilience.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import psutil

from hybrid_pd.common.processes import free_port
from hybrid_pd.common.prom import metric_sum
from hybrid_pd.default_model import resolve_model
from hybrid_pd.stack import Stack, StackConfig

__all__ = ["ChaosReport", "checked_load", "crash", "expected_tokens", "run_chaos", "vllm_group"]

PROMPTS = tuple(f"Request number {i}: the weather today is" for i in range(8))


def vllm_group(url: str) -> int:
    """The process group of the vLLM server listening on ``url``'s port (a worker runs it in a group of its own)."""
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return os.getpgid(conn.pid)
    raise RuntimeError(f"nothing listens on {url}")


def crash(url: str) -> None:
    """SIGKILL the vLLM server behind ``url``, its engine too (a crash: nothing is cleaned up)."""
    os.killpg(vllm_group(url), signal.SIGKILL)


def expected_tokens(colocated: str, model: str, max_tokens: int, prompts: tuple[str, ...] = PROMPTS) -> dict[str, list[int]]:
    """The colocated server's greedy tokens for each prompt: what every answer through P/D must be."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    with httpx.Client(timeout=300) as client:
        return {p: client.post(colocated + "/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["token_ids"] for p in prompts}


async def checked_load(router: str, model: str, expected: dict[str, list[int]], requests: int, concurrency: int,
                       answered: Callable[[int], None] = lambda n: None, unclean: list[str] | None = None) -> Counter[str]:  # fmt: skip
    """Send ``requests`` greedy requests at ``concurrency`` in flight (every other one streamed); count how each ended.

    ``answered`` is told how many have ended after each one; ``unclean`` gets what each unclean ending looked like."""
    why = unclean if unclean is not None else []
    counts: Counter[str] = Counter()
    prompts = list(expected)
    gate = asyncio.Semaphore(concurrency)
    max_tokens = len(next(iter(expected.values())))

    async def one(client: httpx.AsyncClient, i: int) -> None:
        prompt, stream = prompts[i % len(prompts)], i % 2 == 0
        kind = "stream" if stream else "whole"
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
                "ignore_eos": True, "stream": stream}  # fmt: skip
        async with gate:
            try:
                r = await client.post("/v1/completions", json=body)
            except httpx.HTTPError as exc:
                counts["unclean"] += 1
                why.append(f"{kind}: {type(exc).__name__}: {exc}")
                answered(counts.total())
                return
        outcome = _outcome(r, stream, expected[prompt])
        counts[outcome] += 1
        if outcome == "unclean":
            why.append(f"{kind}: HTTP {r.status_code}, {len(r.content)} bytes ending {r.text[-200:]!r}")
        answered(counts.total())

    async with httpx.AsyncClient(base_url=router, timeout=300) as client:
        await asyncio.gather(*(one(client, i) for i in range(requests)))
    return counts


def _outcome(r: httpx.Response, stream: bool, expected: list[int]) -> str:
    if r.status_code != 200:
        return "clean_error" if "error" in r.json() else "unclean"
    if not stream:
        return "correct" if r.json()["choices"][0]["token_ids"] == expected else "wrong"
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "unclean"
    parsed = [json.loads(e) for e in events[:-1]]
    if any("error" in e for e in parsed):
        return "clean_error"
    tokens = [t for e in parsed for c in e.get("choices", []) for t in c.get("token_ids") or []]
    return "correct" if tokens == expected else "wrong"


@dataclass
class ChaosReport:
    """How the load went: see the module docstring for each field."""

    requests: int
    concurrency: int
    seconds: float = 0.0
    correct: int = 0
    wrong: int = 0
    clean_error: int = 0
    unclean: int = 0
    unclean_why: list[str] = field(default_factory=list)
    migrated: int = 0
    retried: int = 0
    fallbacks: int = 0
    crashes: list[str] = field(default_factory=list)
    prefill_kv_held: int = 0


def _router_counts(router: str) -> dict[str, float]:
    text = httpx.get(router + "/metrics", timeout=10).text
    return {
        "migrated": metric_sum(text, 'hybrid_pd_migrations_total{outcome="ok"}'),
        "retried": metric_sum(text, "hybrid_pd_retries_total"),
        "fallbacks": metric_sum(text, "hybrid_pd_fallbacks_total"),
    }


async def _crash_loop(stack: Stack, every_s: float, rng: random.Random, start: asyncio.Event, done: asyncio.Event,
                      crashes: list[str]) -> None:  # fmt: skip
    """From ``start``, then every ``every_s`` while the load runs: crash a worker that is up (never the last decode
    one), restart it."""
    restarts: list[asyncio.Task] = []
    down: set[str] = set()

    async def restart(name: str) -> None:
        stack.restart(name)  # from this thread, which outlives the service (see Stack.restart)
        await asyncio.to_thread(stack.wait_ready, name)
        down.discard(name)

    await start.wait()  # set when the load is done too
    while not done.is_set():
        decodes = [s.name for s in stack.workers("decode") if s.name not in down]
        candidates = [s.name for s in stack.workers("prefill") if s.name not in down] + (decodes if len(decodes) > 1 else [])
        if candidates:
            name = rng.choice(candidates)
            crash(next(s.url for s in stack.services if s.name == name))
            crashes.append(name)
            down.add(name)
            restarts.append(asyncio.ensure_future(restart(name)))
        try:
            await asyncio.wait_for(done.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    await asyncio.gather(*restarts)  # the stack is whole again before it is judged


def _prefill_kv_held(stack: Stack, model: str, idle: dict[str, float], lease_s: float) -> int:
    """Prefill workers still holding state after their lease ran out (a request makes vLLM reap expired leases)."""
    time.sleep(lease_s + 1)
    held = 0
    with httpx.Client(timeout=120) as client:
        for worker in stack.workers("prefill"):
            client.post(worker.url + "/v1/completions", json={"model": model, "prompt": "reap", "max_tokens": 1})
            usage = metric_sum(client.get(worker.url + "/metrics").text, "vllm:kv_cache_usage_perc")
            held += usage > idle[worker.name]
    return held


def run_chaos(stack: Stack, requests: int, concurrency: int, crash_every_s: float, max_tokens: int = 16,
              lease_s: float = 30.0, seed: int = 0) -> ChaosReport:  # fmt: skip
    """The load and the crash loop on a running ``stack`` that has a colocated baseline; the report."""
    model = stack.config.served_model_name
    colocated = stack.workers("colocated")[0].url
    expected = expected_tokens(colocated, model, max_tokens)
    idle = {w.name: metric_sum(httpx.get(w.url + "/metrics").text, "vllm:kv_cache_usage_perc") for w in stack.workers("prefill")}
    before = _router_counts(stack.url)
    report = ChaosReport(requests, concurrency)

    async def both() -> Counter[str]:
        start, done = asyncio.Event(), asyncio.Event()
        chaos = asyncio.ensure_future(_crash_loop(stack, crash_every_s, random.Random(seed), start, done, report.crashes))

        def answered(n: int) -> None:
            if n >= max(1, requests // 4):
                start.set()

        try:
            return await checked_load(stack.url, model, expected, requests, concurrency, answered, report.unclean_why)
        finally:
            done.set()
            start.set()
            await chaos

    started = time.perf_counter()
    counts = asyncio.run(both())
    report.seconds = round(time.perf_counter() - started, 1)
    for key in ("correct", "wrong", "clean_error", "unclean"):
        setattr(report, key, counts[key])
    after = _router_counts(stack.url)
    for key, value in after.items():
        setattr(report, key, int(value - before[key]))
    report.prefill_kv_held = _prefill_kv_held(stack, model, idle, lease_s)
    return report


def _table(report: ChaosReport) -> str:
    rows = [(k, v if not isinstance(v, list) else f"{len(v)} ({', '.join(v)})") for k, v in asdict(report).items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_pd.bench.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the embedded model)")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--crash-every-s", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--log-dir", type=Path, default=Path(".hybrid-pd/chaos-logs"))
    args = parser.parse_args(argv)
    model, name = resolve_model(args.model)
    config = StackConfig(model=model, served_model_name=name, port=free_port(), prefill=args.prefill, decode=args.decode,
                         baseline=True, log_dir=args.log_dir, ready_timeout_s=600)  # fmt: skip
    with Stack(config) as stack:
        report = run_chaos(stack, args.requests, args.concurrency, args.crash_every_s, args.max_tokens, seed=args.seed)
    print(_table(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.wrong == report.unclean == report.prefill_kv_held == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
