"""A worker counts a sampled request's prompt (vLLM's ``/tokenize``), so the planner's lengths are right from a traffic's start.

The router keeps no tokenizer: it estimates a text prompt at 4 bytes a token and corrects the
estimates by the ratio of what the workers counted to what it estimated
(:mod:`hybrid_pd.sizing.traffic`). An answer's usage tells the count only when the answer ends.
On four H200s our tokenizer made ~1.9 bytes a token of the benchmark's text: the chat's
1000-token prompts read as ~480 until the first 512-token answer ended, and the planner, sizing
for 480-token prompts, kept whole requests until then (~5 s; with the count it moves to 1P3D at
its first look). So when no prompt was counted in the last period (:meth:`TrafficWindow.sample_prompt`:
a router that just started, traffic after a pause), the router asks the least busy worker of the
model to count the arriving request's prompt, off the request's path; the count corrects the ratio
within milliseconds. A prompt of token ids needs no count (its estimate is its length) and a
sample that fails changes nothing: the answers' usage corrects the ratio as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from hybrid_pd.common.logs import kv
from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.router.aux_endpoints import choose_worker
from hybrid_pd.router.jsoncodec import dumps
from hybrid_pd.router.state import RouterState

__all__ = ["COUNT_TIMEOUT_S", "count_prompt", "tokenize_body"]

COUNT_TIMEOUT_S = 2.0  # a count later than this is no earlier than the answer's usage for most requests

log = logging.getLogger("hybrid_pd.router")
_counting: set[asyncio.Future[None]] = set()  # the counts under way: asyncio keeps only weak references to tasks


def tokenize_body(body: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's ``/tokenize`` request for the prompt of generation request ``body`` (the model's chat template applied, as its
    usage counts), or None where a count tells nothing the estimate does not (token ids) or is not one prompt."""
    model = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
    if isinstance(body.get("messages"), list):
        return {**model, "messages": body["messages"]}
    if isinstance(body.get("prompt"), str):
        return {**model, "prompt": body["prompt"]}
    return None


def count_prompt(state: RouterState, body: dict[str, Any], estimate: int, request_id: str, now: float) -> None:
    """Where the planner's traffic window wants a sample ``now``, have a worker count ``body``'s prompt, estimated at
    ``estimate``, without waiting for it; the count goes to the window."""
    ask = tokenize_body(body)
    if ask is None or not state.planner.traffic.sample_prompt(now):  # token ids do not use up the period's sample
        return
    task = asyncio.ensure_future(_count(state, ask, estimate, request_id))
    _counting.add(task)
    task.add_done_callback(_counting.discard)


async def _count(state: RouterState, ask: dict[str, Any], estimate: int, request_id: str) -> None:
    assert state.upstream is not None
    try:
        worker = await choose_worker(state, ask.get("model"))
        answer = await state.upstream.request(
            "POST", worker.url + "/tokenize", json_body=dumps(ask), headers={"X-Request-Id": request_id}, timeout=COUNT_TIMEOUT_S
        )
        count = answer.json()["count"] if answer.status_code == 200 else None
    except (OpenAIError, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        log.debug("prompt count failed %s", kv(error=f"{type(exc).__name__}: {exc}"))
        return
    if isinstance(count, int) and not isinstance(count, bool) and count > 0:
        state.planner.traffic.prompt_counted(time.perf_counter(), estimate, count)
        log.debug("prompt counted %s", kv(estimate=estimate, tokens=count, ratio=round(state.planner.traffic.prompt_ratio, 3)))
