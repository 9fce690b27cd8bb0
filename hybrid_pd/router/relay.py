"""What the client gets from its decode answer(s): answers merged, streams relayed, usage rewritten.

A decode answer counts the prompt as the decode worker saw it; the client's usage takes its
prompt tokens (and cache hits) from the prefill leg (:func:`merge_usage`). A completions
request with several prompts ran as one pair per prompt, and their answers become one:
choices renumbered in prompt order, usages summed.

One stream is relayed as the bytes that come (:func:`relay_one`): each read is cut after its
last complete event and only an event that carries a usage object is parsed, so a token event
costs the router no JSON work (``docs/performance.md``, "Bytes relayed"). Several streams
are merged event by event (:func:`relay_several`), each event parsed. Both work on byte
chunks; :func:`answer_whole` and :func:`relay_answers` put them on the open decode answers
of a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import Send

from hybrid_pd.common.logs import kv
from hybrid_pd.common.openai_errors import error_event
from hybrid_pd.common.sse import sse_lines
from hybrid_pd.router.jsoncodec import dumps
from hybrid_pd.router.metrics import Route, RouterMetrics
from hybrid_pd.router.route import Routed

__all__ = ["DecodeStream", "StreamBroke", "answer_whole", "merge_answers", "merge_usage", "relay_answers", "relay_one", "relay_several"]

log = logging.getLogger("hybrid_pd.router")

# Told the usage a client's answer carries (prompt and completion tokens): what the planner sizes by (hybrid_pd/sizing/traffic.py).
UsageSeen = Callable[[dict[str, Any]], None]


def merge_usage(prefill_usage: dict[str, Any] | None, decode_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """One usage for the client: prompt tokens (and cache hits) from prefill, completion from decode."""
    if decode_usage is None:
        return None
    if prefill_usage is None:
        return decode_usage
    prompt = prefill_usage.get("prompt_tokens", decode_usage.get("prompt_tokens", 0))
    completion = decode_usage.get("completion_tokens", 0)
    merged = {**decode_usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if prefill_usage.get("prompt_tokens_details") is not None:
        merged["prompt_tokens_details"] = prefill_usage["prompt_tokens_details"]
    return merged


def merge_answers(answers: Sequence[dict], prefill_usages: Sequence[dict | None], prompts: Sequence[int]) -> dict:
    """One answer from whole decode answers, one per choice in order, each given its prefill's usage.

    ``prompts[i]`` is the client's prompt that answer ``i`` is a choice of. The answers are
    changed in place: their usage becomes the merged one. Several answers become the first
    with choice ``i`` numbered ``i`` and the usages summed, each prompt counted once.
    """
    for answer, prefill_usage in zip(answers, prefill_usages, strict=True):
        answer["usage"] = merge_usage(prefill_usage, answer.get("usage"))
    if len(answers) == 1:
        return answers[0]
    merged = dict(answers[0])
    merged["choices"] = [{**choice, "index": i} for i, a in enumerate(answers) for choice in a["choices"]]
    merged["usage"] = _sum_usage([a.get("usage") for a in answers], prompts)
    return merged


def _sum_usage(usages: Sequence[dict | None], prompts: Sequence[int]) -> dict | None:
    """The usage of one request from its choices' usages: completion tokens summed, prompt tokens once per prompt."""
    present = [(u, p) for u, p in zip(usages, prompts, strict=True) if u]
    if not present:
        return None
    first_of_prompt = {p: u for u, p in reversed(present)}
    prompt = sum(u.get("prompt_tokens") or 0 for u in first_of_prompt.values())
    completion = sum(u.get("completion_tokens") or 0 for u, _ in present)
    return {**present[0][0], "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class DecodeStream:
    """One streamed decode answer as it arrives: its bytes, the worker sending them, the prefill usage to merge in."""

    chunks: AsyncIterator[bytes]
    worker: str
    prefill_usage: dict | None
    prompt: int = 0  # which of the client's prompts this stream is a choice of


class StreamBroke(Exception):
    """A decode stream failed mid-way; the client gets an error event instead of the rest."""

    def __init__(self, worker: str, error: BaseException) -> None:
        super().__init__(f"{worker}: {type(error).__name__}")
        self.worker, self.error = worker, type(error).__name__


async def relay_one(stream: DecodeStream, usage_seen: UsageSeen = lambda usage: None) -> AsyncIterator[bytes]:
    """One decode stream's bytes as they arrive, cut after the last complete event of each read.

    Only an event that carries a usage object is parsed (to merge the prefill's usage into it,
    and tell ``usage_seen`` the client's usage); vLLM sends one, the last before its own
    ``[DONE]``, which goes to the client as it came. A read that fails (``httpx.HTTPError``)
    is :class:`StreamBroke`; an event it cut is dropped.
    """
    pending = b""
    try:
        async for data in stream.chunks:
            pending += data
            end = pending.rfind(b"\n\n")
            if end < 0:
                continue  # no complete event yet
            events, pending = pending[: end + 2], pending[end + 2 :]
            # vLLM writes compact JSON: a token event has no usage or "usage":null.
            if b'"usage":{' in events:
                events = _merge_usage_events(events, stream.prefill_usage, usage_seen)
            yield events
    except httpx.HTTPError as exc:
        raise StreamBroke(stream.worker, exc) from exc
    if pending:
        yield pending


def _merge_usage_events(events: bytes, prefill_usage: dict | None, usage_seen: UsageSeen) -> bytes:
    """``events`` (complete SSE events) with the prefill's usage (if any) merged into each usage object, which ``usage_seen`` is told."""
    out = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            parsed = json.loads(event[6:])
            usage = parsed["usage"] = merge_usage(prefill_usage, parsed["usage"])
            usage_seen(usage)
            if prefill_usage is not None:
                event = b"data: " + dumps(parsed)
        out.append(event)
    return b"\n\n".join(out)


async def relay_several(streams: Sequence[DecodeStream], body: dict, answer_id: str, usage_seen: UsageSeen = lambda usage: None) -> AsyncIterator[bytes]:
    """Decode streams of one choice each, in the order of the client's choices, merged event by event into one answer.

    Stream ``i`` is choice ``i``; the usages are summed into one final usage event (id
    ``answer_id``, sent if ``body`` asked for usage), so every event is parsed here; one
    ``[DONE]`` ends the answer. A stream that fails is :class:`StreamBroke`.
    """
    usages: list[dict | None] = [None] * len(streams)
    queue: asyncio.Queue[tuple[int, bytes | None | BaseException]] = asyncio.Queue()

    async def pump(i: int, stream: DecodeStream) -> None:
        try:
            async for line in sse_lines(stream.chunks):
                await queue.put((i, line))
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer below
            await queue.put((i, exc))
        else:
            await queue.put((i, None))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(streams)
    try:
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, BaseException):
                raise StreamBroke(streams[i].worker, item) from item
            if not item or item.startswith(b"data: [DONE]"):
                continue  # events are re-delimited below; one [DONE] ends the merged answer
            if not item.startswith(b"data: {"):
                yield item + b"\n\n"
                continue
            event = json.loads(item[6:])
            if event.get("usage") is not None:
                usages[i] = merge_usage(streams[i].prefill_usage, event["usage"])
                if not event.get("choices"):
                    continue  # the merged usage chunk goes out once, at the end
            event["choices"] = [{**c, "index": i} for c in event.get("choices", [])]
            event.pop("usage", None)
            yield b"data: " + dumps(event) + b"\n\n"
        if any(usages):
            total = _sum_usage(usages, [s.prompt for s in streams])
            usage_seen(total)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield b"data: " + dumps({"id": answer_id, "object": "text_completion", "choices": [], "usage": total}) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()


async def answer_whole(
    metrics: RouterMetrics, routed: Sequence[Routed], failed: Routed | None, usage_seen: UsageSeen = lambda usage: None
) -> tuple[int, bytes]:
    """A whole (non-streamed) answer, or the first failed answer's error as it came: (status, JSON). Closes every answer;
    ``usage_seen`` is told the answer's usage.

    Each decode leg read whole is timed (``decode_leg``) when its last byte is in, as a streamed one is.
    """

    async def read(r: Routed) -> bytes:
        content = await r.response.aread()
        if r.worker.role == "decode":  # not a prefill worker's refusal
            metrics.decode_leg.observe(time.perf_counter() - r.sent_at)
        return content

    try:
        if failed is not None:
            return failed.response.status_code, await read(failed)
        answers = [json.loads(content) for content in await asyncio.gather(*(read(r) for r in routed))]
        merged = merge_answers(answers, [r.prefill_usage for r in routed], [r.prompt for r in routed])
        if merged.get("usage"):
            usage_seen(merged["usage"])
        return 200, dumps(merged)
    finally:
        for r in routed:
            await r.aclose()


async def relay_answers(
    metrics: RouterMetrics,
    routed: Sequence[Routed],
    chunks_of: Callable[[Routed], AsyncIterator[bytes]],
    body: dict,
    arrived: float,
    route: Route,
    send: Send,
    usage_seen: UsageSeen = lambda usage: None,
) -> None:
    """Stream the decode answer(s) to the client with merged usage, as ``http.response.body`` messages.

    ``chunks_of(answer)`` gives the bytes of one open answer (the route layer's: they may
    come from a migrated stream). The answer's start has been sent, its end is the caller's.
    Cancelling this (client gone) closes every upstream stream, which makes vLLM abort the
    request. ``route`` labels the request in the metrics; ``arrived`` is when it reached the router;
    ``usage_seen`` is told the client's usage when the answer carries one.
    """
    streams = [DecodeStream(chunks_of(r), r.worker.url, r.prefill_usage, r.prompt) for r in routed]
    if len(streams) == 1:
        chunks = relay_one(streams[0], usage_seen)
    else:
        chunks = relay_several(streams, body, routed[0].response.headers.get("x-request-id", ""), usage_seen)
    first, last = True, time.perf_counter()
    # One stream's chunk gaps are its decode worker's time per output token (hybrid_pd/router/load.py).
    paced = routed[0].worker.load if len(routed) == 1 else None
    outcome = "ok"
    try:
        try:
            async for chunk in chunks:
                now = time.perf_counter()
                if first:
                    metrics.ttft.observe(now - arrived)
                    first = False
                else:
                    metrics.itl.observe(now - last)
                    if paced is not None:
                        paced.chunk_gap(now - last, now)
                last = now
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except StreamBroke as broke:
            outcome = "stream_error"
            log.warning("decode stream broke %s", kv(worker=broke.worker, error=broke.error))
            await send({"type": "http.response.body", "body": error_event(502, f"decode worker failed mid-stream: {broke.error}"), "more_body": True})
    except asyncio.CancelledError:
        outcome = "client_disconnected"
        log.info("client disconnected; aborting decode %s", kv(workers=[s.worker for s in streams]))
        raise
    finally:
        await chunks.aclose()
        for r in routed:
            await r.aclose()
        metrics.finished(route, outcome, arrived)
        ended = time.perf_counter()
        for r in routed:
            metrics.decode_leg.observe(ended - r.sent_at)
