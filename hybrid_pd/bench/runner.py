"""Load against targets: one level (fixed concurrency or Poisson arrivals) at a time, targets interleaved.

At every load level each target gets the same prompts, the endpoint first and the
baseline right after it, so a slow drift of the machine (another job, thermal limits)
hits both alike; each level has prompts of its own, so no level's prompts are in a
prefix cache that an earlier level filled.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from hybrid_pd.bench.client import ClientPool, RequestResult, Sampling, base_url, complete
from hybrid_pd.eval.progress import Progress

__all__ = ["Load", "Target", "TargetRun", "level_request_ids", "parse_loads", "run_level", "run_levels", "warm_up"]

log = logging.getLogger("hybrid_pd.bench")

LoadKind = Literal["concurrency", "rate"]

_RATE_RESERVE = 64  # clients made ahead for a rate level (more are made when more requests overlap)


@dataclass(frozen=True)
class Load:
    """A load level: ``concurrency`` requests always in flight, or Poisson arrivals at ``rate`` per second."""

    kind: LoadKind
    value: float

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"c={int(self.value)}"
        return "rate=inf" if self.value == float("inf") else f"rate={self.value:g}/s"

    @property
    def tag(self) -> str:
        """The level in a request id: ``c32``, ``r2.5``, ``rinf``."""
        return f"c{int(self.value)}" if self.kind == "concurrency" else f"r{self.value:g}"

    def to_json(self) -> dict[str, object]:
        value: object = int(self.value) if self.kind == "concurrency" else self.value
        return {"kind": self.kind, "value": "inf" if value == float("inf") else value}


@dataclass(frozen=True)
class Target:
    """A server under test: ``role`` is "endpoint" or "baseline"."""

    role: str
    url: str
    model: str

    @property
    def completions_url(self) -> str:
        return base_url(self.url) + "/v1/completions"


@dataclass(frozen=True)
class TargetRun:
    """Every request one target got at one load level, and the level's wall time."""

    target: Target
    load: Load
    results: tuple[RequestResult, ...]
    duration_s: float


def parse_loads(kind: LoadKind, text: str) -> list[Load]:
    """``"1,8,32"`` -> loads; concurrencies are integers >= 1, rates numbers > 0 (``inf``: all at once)."""
    loads = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        value = float(part)
        if kind == "concurrency" and (value != int(value) or value < 1):
            raise ValueError(f"a concurrency is an integer >= 1, got {part!r}")
        if kind == "rate" and not value > 0:
            raise ValueError(f"a rate is a number > 0 (or inf), got {part!r}")
        loads.append(Load(kind, value))
    if not loads:
        raise ValueError(f"no {kind} given")
    return loads


async def run_level(
    pool: ClientPool,
    target: Target,
    prompts: Sequence[list[int]],
    sampling: Sampling,
    load: Load,
    seed: int = 0,
    progress: Progress | None = None,
    request_ids: str | None = None,
) -> TargetRun:
    """Send every prompt to ``target`` at ``load``; results are in prompt order.

    ``request_ids``: request ``i`` is sent with ``X-Request-Id: <request_ids>-<i>`` (the
    hand-off timeline finds a level's requests by it); None: with none.
    """
    url = target.completions_url
    results: list[RequestResult | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        request_id = None if request_ids is None else f"{request_ids}-{i}"
        async with pool.client(url) as client:
            results[i] = result = await complete(client, url, sampling.body(prompts[i]), request_id)
        if progress is not None:
            progress.advance(error=not result.ok)

    in_flight = int(load.value) if load.kind == "concurrency" else _RATE_RESERVE
    pool.reserve(url, min(in_flight, len(prompts)))
    started = time.perf_counter()
    if load.kind == "concurrency":
        queue = iter(range(len(prompts)))

        async def worker() -> None:
            for i in queue:  # the workers share one iterator: each index is taken once
                await one(i)

        await asyncio.gather(*(worker() for _ in range(max(1, min(int(load.value), len(prompts))))))
    else:
        await _poisson(one, len(prompts), load.value, seed)
    duration = time.perf_counter() - started
    return TargetRun(target, load, tuple(r for r in results if r is not None), duration)


async def _poisson(one: Callable[[int], Awaitable[None]], count: int, rate: float, seed: int) -> None:
    """Start ``one(i)`` for i in 0..count-1 at Poisson arrival times (exponential gaps, mean 1/rate)."""
    rng = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    at = 0.0
    for i in range(count):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
        if rate != float("inf"):
            at += rng.expovariate(rate)
    await asyncio.gather(*tasks)


def level_request_ids(run_id: str, role: str, load: Load) -> str:
    """The prefix of the request ids one target gets at one level of run ``run_id``."""
    return f"{run_id}-{role}-{load.tag}"


async def warm_up(pool: ClientPool, target: Target, prompts: Sequence[list[int]], sampling: Sampling) -> None:
    """Send ``prompts`` one at a time and forget the answers (first-request costs stay out of the figures)."""
    for prompt in prompts:
        async with pool.client(target.completions_url) as client:
            result = await complete(client, target.completions_url, sampling.body(prompt))
        if not result.ok:
            log.warning("warm-up request to %s %s failed: %s", target.role, target.url, result.error)


async def run_levels(
    pool: ClientPool,
    targets: Sequence[Target],
    level_prompts: Sequence[Sequence[list[int]]],
    output_len: int,
    loads: Sequence[Load],
    seed: int = 0,
    show_progress: bool | None = None,
    stream: bool = True,
    run_id: str | None = None,
) -> list[list[TargetRun]]:
    """For each load level (with its own prompts), every target in turn: ``runs[level][target]``.

    ``run_id``: requests carry ids ``<run_id>-<role>-<load tag>-<i>`` (:func:`level_request_ids`).
    """
    runs: list[list[TargetRun]] = []
    for level, (load, prompts) in enumerate(zip(loads, level_prompts, strict=True)):
        level_runs = []
        for target in targets:
            log.info("%s %s at %s: %d requests", target.role, target.url, load.label, len(prompts))
            progress = Progress(f"{target.role} {load.label}", len(prompts), enabled=show_progress)
            try:
                sampling = Sampling(target.model, output_len, stream=stream)
                ids = None if run_id is None else level_request_ids(run_id, target.role, load)
                level_runs.append(await run_level(pool, target, prompts, sampling, load, seed + level, progress, ids))
            finally:
                progress.close()
        runs.append(level_runs)
    return runs
