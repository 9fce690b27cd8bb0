"""One timed completion request: streamed (SSE) by default, or one JSON answer.

Timing follows vLLM's ``benchmark_serving``: the clock starts just before the request is
sent; the first server-sent event that carries ``choices`` is the first token (TTFT); the
gaps between later such events are inter-token latencies (ITL; an event carrying several
tokens counts as one gap); end-to-end latency runs until ``[DONE]``. Token counts come from
the final ``usage`` event (``stream_options.include_usage``); when a server sends none, the
events that carried tokens are counted instead and the result says so.

Nothing raises: a failed request (connection error, non-200 status, an error event, a
stream cut short, malformed JSON) is a :class:`RequestResult` with ``error`` set.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from hybrid_pd.common.sse import sse_lines
from hybrid_pd.eval.client import EndpointError, base_url

__all__ = ["ClientPool", "EndpointError", "RequestResult", "Sampling", "base_url", "complete", "model_entry"]

_ERROR_BODY_CHARS = 300


@dataclass(frozen=True)
class Sampling:
    """What every request asks for besides its prompt: exactly ``output_len`` tokens (EOS ignored)."""

    model: str
    output_len: int
    stream: bool = True

    def body(self, prompt: list[int]) -> dict[str, Any]:
        """The ``/v1/completions`` request body for a token-id ``prompt``."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass(frozen=True)
class RequestResult:
    """One request's timings (seconds, from ``time.perf_counter``) and token counts."""

    sent_at: float
    e2e_s: float
    ttft_s: float | None = None  # None for a JSON (non-streamed) answer or a failed request
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_reported: bool = False
    error: str | None = None
    status: int | None = None
    output_ids: tuple[int, ...] = ()  # streamed ``token_ids`` (vLLM's ``return_token_ids``), when asked for

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: ``(e2e - TTFT) / (output tokens - 1)``."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def done_at(self) -> float:
        return self.sent_at + self.e2e_s


@dataclass
class _Stream:
    """What has been seen of one SSE answer so far."""

    first: float | None = None
    last: float = 0.0
    gaps: list[float] = field(default_factory=list)
    events_with_tokens: int = 0
    usage: dict[str, Any] | None = None
    ids: list[int] = field(default_factory=list)
    done_at: float | None = None  # when ``[DONE]`` arrived
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.done_at is not None

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments, other SSE fields
        data = line[5:].strip()
        if data == "[DONE]":
            self.done_at = now
            return
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"event is a {type(event).__name__}, not an object")
        if event.get("error") is not None:
            err = event["error"]
            self.error = f"error event: {err.get('message', err) if isinstance(err, dict) else err}"
            return
        if event.get("choices"):
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now
            self.events_with_tokens += 1
            self.ids.extend(event["choices"][0].get("token_ids") or ())
        if event.get("usage"):
            self.usage = event["usage"]


async def complete(client: httpx.AsyncClient, url: str, body: dict[str, Any], request_id: str | None = None) -> RequestResult:
    """Send one completion request to ``url`` (the full ``.../v1/completions`` URL) and time it; ``request_id``: its ``X-Request-Id``."""
    headers = None if request_id is None else {"X-Request-Id": request_id}
    if body.get("stream"):
        return await _streamed(client, url, body, headers)
    return await _whole(client, url, body, headers)


async def _streamed(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None) -> RequestResult:
    sent = time.perf_counter()
    seen = _Stream()
    status = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            status = response.status_code
            if status != 200:
                text = (await response.aread()).decode("utf-8", "replace")[:_ERROR_BODY_CHARS]
                return RequestResult(sent, time.perf_counter() - sent, error=f"HTTP {status}: {text}", status=status)
            # Read to the end even after [DONE], so that the connection goes back to the pool.
            async for raw in sse_lines(response.aiter_bytes()):
                if not seen.done:
                    seen.feed(raw.decode("utf-8", "replace"), time.perf_counter())
                if seen.error:
                    break
    except httpx.HTTPError as exc:
        return RequestResult(sent, time.perf_counter() - sent, error=_describe(exc), status=status)
    except ValueError as exc:  # json.JSONDecodeError included
        return RequestResult(sent, time.perf_counter() - sent, error=f"malformed event ({exc})", status=status)
    e2e = (seen.done_at if seen.done_at is not None else time.perf_counter()) - sent
    error = seen.error
    if error is None and not seen.done:
        error = "stream ended before [DONE]"
    elif error is None and seen.first is None:
        error = "stream carried no tokens"
    usage = seen.usage or {}
    tokens = usage.get("completion_tokens")
    return RequestResult(
        sent_at=sent,
        e2e_s=e2e,
        ttft_s=None if seen.first is None else seen.first - sent,
        itl_s=tuple(seen.gaps),
        prompt_tokens=usage.get("prompt_tokens"),
        output_tokens=tokens if isinstance(tokens, int) else seen.events_with_tokens,
        usage_reported=isinstance(tokens, int),
        error=error,
        status=status,
        output_ids=tuple(seen.ids),
    )


async def _whole(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None) -> RequestResult:
    sent = time.perf_counter()
    try:
        response = await client.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        return RequestResult(sent, time.perf_counter() - sent, error=_describe(exc))
    e2e = time.perf_counter() - sent
    status = response.status_code
    if status != 200:
        return RequestResult(sent, e2e, error=f"HTTP {status}: {response.text[:_ERROR_BODY_CHARS]}", status=status)
    try:
        answer = response.json()
        if not answer["choices"]:
            raise ValueError("no choices")
        usage = answer.get("usage") or {}
    except (ValueError, KeyError, TypeError) as exc:
        return RequestResult(sent, e2e, error=f"malformed response ({type(exc).__name__}: {exc})", status=status)
    tokens = usage.get("completion_tokens")
    return RequestResult(
        sent_at=sent,
        e2e_s=e2e,
        prompt_tokens=usage.get("prompt_tokens"),
        output_tokens=tokens if isinstance(tokens, int) else 0,
        usage_reported=isinstance(tokens, int),
        status=status,
    )


class ClientPool:
    """HTTP clients of one connection each, one per request in flight, reused (keep-alive) per server.

    One shared ``httpx.AsyncClient`` scans every pooled connection on each request
    (httpcore's ``_assign_requests_to_connections``): at 256 requests in flight that
    measured 7x the client CPU per request of 1 in flight, and a load generator that
    slows down under load skews the latencies it reports. A free list of
    single-connection clients per server takes O(1) per request and keeps each target's
    connections open while the other target is measured. The clients share one TLS
    context (a client of its own builds one: 17 ms each, measured) and :meth:`reserve`
    makes them before a level starts, so that no request's latency includes making its client.
    """

    def __init__(self, timeout: httpx.Timeout | float) -> None:
        self._timeout = timeout
        self._tls = httpx.create_ssl_context()
        self._idle: dict[str, list[httpx.AsyncClient]] = {}
        self._count: dict[str, int] = {}
        self._all: list[httpx.AsyncClient] = []

    def _new(self, server: str) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        client = httpx.AsyncClient(timeout=self._timeout, limits=limits, verify=self._tls)
        self._all.append(client)
        self._count[server] = self._count.get(server, 0) + 1
        return client

    def reserve(self, url: str, count: int) -> None:
        """Have at least ``count`` clients for ``url``'s server (made now, not during a measurement)."""
        server = base_url(url)
        while self._count.get(server, 0) < count:
            self._idle.setdefault(server, []).append(self._new(server))

    @asynccontextmanager
    async def client(self, url: str) -> AsyncIterator[httpx.AsyncClient]:
        """A client for ``url``'s server that no other request is using right now."""
        server = base_url(url)
        idle = self._idle.setdefault(server, [])
        client = idle.pop() if idle else self._new(server)
        try:
            yield client
        finally:
            idle.append(client)

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()
        self._all.clear()
        self._idle.clear()
        self._count.clear()

    async def __aenter__(self) -> ClientPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


async def model_entry(client: httpx.AsyncClient, endpoint: str) -> dict[str, Any]:
    """The first model ``endpoint`` serves (``GET /v1/models``): its ``id`` and, from vLLM, its ``root``."""
    url = base_url(endpoint) + "/v1/models"
    try:
        response = await client.get(url)
        response.raise_for_status()
        entry = response.json()["data"][0]
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise TypeError("data[0].id is not a string")
        return entry
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise EndpointError(f"cannot list the models of {url} ({type(exc).__name__}: {exc}); pass --model") from exc
