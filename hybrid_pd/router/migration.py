"""Mid-stream migration: a completions stream whose decode worker dies or freezes goes on on another one.

A streamed completions decode leg is asked for its token ids (``return_token_ids``, a vLLM
extension: the first event carries the prompt's ids, every event its new tokens' ids); unless
the client asked for them too, they are turned back into the ``null`` vLLM writes without it,
on the bytes, so the client sees the stream it would have. When the stream breaks (the
connection fails: the worker died) or stalls (no byte for ``decode_stall_timeout_s``: the
worker is frozen, or hung), the router continues the request elsewhere:

- the continuation's prompt is the prompt's token ids plus every token the client was sent,
  and it asks for the tokens still missing (``max_tokens``, ``min_tokens`` reduced, no echo);
- it runs through a new pair, prefill and another decode worker (:func:`route`), so the
  state of the prompt and the text so far crosses NIXL like any request's;
- its events read as the rest of the first stream: the first stream's id, no prompt ids,
  token ids as the client asked, logprob text offsets shifted by the text already sent, and
  one final usage that counts the client's prompt once and every generated token.

The client sees one stream: no error event, no token missing or repeated. Greedy output
equals an uninterrupted run. Seeded sampling does not: the continuation draws from a new
generator with the same seed, so the tokens after the migration differ from those an
uninterrupted run would have drawn (still a valid sample). Requests with stop strings are
not migrated (vLLM holds back text that may begin a stop string, so the text sent lags the
tokens, and a stop string across the break would go unseen), nor requests with continuous
usage stats; for them, and past ``migration_limit`` migrations, a break still ends the
stream with an error event. A non-streamed request needs none of this: its answer comes
whole at the end, so a decode worker that fails before answering is replaced from scratch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from hybrid_pd.common.logs import kv
from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.router.jsoncodec import dumps

__all__ = ["Opened", "Progress", "StreamStalled", "continuation_body", "is_migratable", "migrating_chunks", "with_stall_timeout", "with_token_ids"]

log = logging.getLogger("hybrid_pd.router")

# Both ``"prompt_token_ids":[...]`` and ``"token_ids":[...]``; a literal start keeps it ~4 us an event
# (an alternation cost 23). Inside a JSON string the quote would be escaped, so text never matches.
_IDS = re.compile(rb'token_ids":\[[0-9,]*\]')


class StreamStalled(httpx.ReadTimeout):
    """No byte from a decode stream for longer than the stall timeout: treated like a broken stream."""


def is_migratable(path: str, body: dict[str, Any]) -> bool:
    """Whether a stream of ``body`` on ``path`` can be carried to another decode worker (see the module docstring)."""
    options = body.get("stream_options")
    return (
        path == "/v1/completions"
        and bool(body.get("stream"))
        and body.get("n", 1) == 1
        and not body.get("stop")
        and not (isinstance(options, dict) and options.get("continuous_usage_stats"))
    )


def with_token_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The request a migratable stream is sent as: the same, with its token ids asked for."""
    return body if body.get("return_token_ids") is True else {**body, "return_token_ids": True}


@dataclass
class Progress:
    """What the client has been sent of one choice, read from the events it was sent."""

    id: str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0  # characters of text sent, echoed prompt included: where logprob text offsets go on
    finished: bool = False

    def read(self, events: bytes) -> None:
        """Take in complete events as vLLM sent them (with their token ids)."""
        for event in events.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            parsed = json.loads(event[6:])
            self.id = self.id or parsed.get("id")
            for choice in parsed.get("choices") or ():
                if self.prompt_token_ids is None and choice.get("prompt_token_ids") is not None:
                    self.prompt_token_ids = list(choice["prompt_token_ids"])
                self.token_ids += choice.get("token_ids") or ()
                self.text_chars += len(choice.get("text") or "")
                self.finished = self.finished or choice.get("finish_reason") is not None


def continuation_body(body: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """The request for the rest of a stream: prompt and tokens sent so far as one token-id prompt.

    Before any event (nothing sent, the prompt's ids unknown) it is the request itself.
    """
    if progress.prompt_token_ids is None:
        return with_token_ids(body)
    sent = len(progress.token_ids)
    out = {**body, "prompt": progress.prompt_token_ids + progress.token_ids, "echo": False, "return_token_ids": True}
    if isinstance(body.get("max_tokens"), int):
        out["max_tokens"] = body["max_tokens"] - sent
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - sent)
    return out


def _client_view(events: bytes, client_wants_ids: bool) -> bytes:
    """The first stream's events as the client asked for them: token ids back to ``null`` unless wanted."""
    return events if client_wants_ids else _IDS.sub(b'token_ids":null', events)


def _as_rest_of(events: bytes, first: Progress, client_wants_ids: bool) -> bytes:
    """A continuation's events rewritten to read as the rest of the stream that sent ``first``."""
    out = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data: {"):
            parsed = json.loads(event[6:])
            parsed["id"] = first.id or parsed.get("id")
            for choice in parsed.get("choices") or ():
                choice["prompt_token_ids"] = None
                if not client_wants_ids:
                    choice["token_ids"] = None
                logprobs = choice.get("logprobs")
                if isinstance(logprobs, dict) and logprobs.get("text_offset"):
                    logprobs["text_offset"] = [o + first.text_chars for o in logprobs["text_offset"]]
            usage = parsed.get("usage")
            if isinstance(usage, dict) and first.prompt_token_ids is not None:
                prompt = len(first.prompt_token_ids)
                completion = len(first.token_ids) + (usage.get("completion_tokens") or 0)
                parsed["usage"] = {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
            event = b"data: " + dumps(parsed)
        out.append(event)
    return b"\n\n".join(out)


async def with_stall_timeout(chunks: AsyncIterator[bytes], stall_s: float) -> AsyncIterator[bytes]:
    """``chunks``, raising :class:`StreamStalled` when none comes for ``stall_s`` seconds."""
    iterator = chunks.__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(iterator.__anext__(), stall_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise StreamStalled(f"no byte for {stall_s:g} s") from None
        yield chunk


@dataclass
class Opened:
    """An open decode stream: its bytes, its decode worker, and how to let it go (closing twice is harmless)."""

    chunks: AsyncIterator[bytes]
    worker_id: str
    worker_url: str
    close: Callable[[], Awaitable[None]]


async def migrating_chunks(
    first: Opened,
    body: dict[str, Any],
    reroute: Callable[[dict[str, Any], set[str]], Awaitable[Opened]],
    limit: int,
    stall_s: float,
    on_migrated: Callable[[str], None],
) -> AsyncIterator[bytes]:
    """The bytes of one completions stream, complete events only, carried on elsewhere when its worker fails.

    ``reroute(body, avoid)`` opens a stream of ``body`` on a new pair, avoiding the decode
    workers whose ids are in ``avoid``. ``on_migrated(outcome)`` counts each attempt (``ok``,
    ``failed``). A break that cannot be carried on (limit reached, the choice already
    finished, no worker left) raises the stream's own error. ``first`` is its caller's to
    close; every continuation is closed here.
    """
    client_wants_ids = body.get("return_token_ids") is True
    sent = Progress()  # what the client was sent by the streams before the current one
    current, rewrite, migrations, avoid = first, False, 0, {first.worker_id}
    try:
        while True:
            relayed: list[bytes] = []  # parsed only if the stream breaks: token events cost no JSON work
            pending = b""
            try:
                async for data in with_stall_timeout(current.chunks, stall_s):
                    pending += data
                    end = pending.rfind(b"\n\n")
                    if end < 0:
                        continue
                    events, pending = pending[: end + 2], pending[end + 2 :]
                    relayed.append(events)
                    yield _as_rest_of(events, sent, client_wants_ids) if rewrite else _client_view(events, client_wants_ids)
                if pending:
                    yield pending
                return
            except httpx.HTTPError as exc:
                this = Progress()
                this.read(b"".join(relayed))
                if migrations >= limit or this.finished:
                    raise
                if rewrite:
                    sent.token_ids += this.token_ids
                    sent.text_chars += this.text_chars
                else:  # the first stream, or one restarted from scratch: what it sent is all there is
                    sent = this
                log.warning("decode stream broke, migrating %s", kv(worker=current.worker_url, error=type(exc).__name__, sent_tokens=len(sent.token_ids)))
                await current.close()  # vLLM aborts the request once it sees the connection gone
                try:
                    following = await reroute(continuation_body(body, sent), avoid)
                except OpenAIError:
                    on_migrated("failed")
                    raise exc from None
                on_migrated("ok")
                current, migrations = following, migrations + 1
                rewrite = sent.prompt_token_ids is not None
                avoid.add(current.worker_id)
    finally:
        if current is not first:
            await current.close()
