"""When an HTTP request arrived and when its answer's first byte left: the timeline's HTTP edge.

:class:`TimelineMiddleware` is plain ASGI, so it times the server itself and nothing of a
framework's: ``http_in`` when the server hands the request over, ``http_out`` when the
first non-empty body message goes out (a stream's first token event, or a whole JSON
answer). The same class wraps the router (``hybrid_pd/cli.py``) and, through vLLM's own
``--middleware`` option, a prefill or decode worker's vLLM server (``hybrid_pd/connector/launch.py``),
where it reads its writer from the environment. Requests are named by their
``X-Request-Id``: the one the request came with (the router sends its own to both legs),
else the one the answer carries (the router's, when the client sent none); a request with
neither is not recorded. Both events are written when the first byte leaves, so a request
refused before any body is never half recorded.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from hybrid_pd.connector.trace.timeline import TimelineWriter, from_env

__all__ = ["TimelineMiddleware"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

_REQUEST_ID = b"x-request-id"


def _request_id(headers: Any) -> str | None:
    for name, value in headers or ():
        if name.lower() == _REQUEST_ID:
            return value.decode("latin-1")
    return None


class TimelineMiddleware:
    """Record ``http_in`` and ``http_out`` of every HTTP request that has a request id; ``writer`` None: from the environment."""

    def __init__(self, app: ASGIApp, writer: TimelineWriter | None = None) -> None:
        self.app = app
        self.writer = writer if writer is not None else from_env()

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]) -> None:
        writer = self.writer
        if writer is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = time.monotonic()
        rid = _request_id(scope.get("headers"))
        first_sent = False

        async def timed_send(message: Message) -> None:
            nonlocal rid, first_sent
            if message["type"] == "http.response.start" and rid is None:
                rid = _request_id(message.get("headers"))
            elif message["type"] == "http.response.body" and not first_sent and message.get("body"):
                first_sent = True
                if rid is not None:
                    writer.event("http_in", rid=rid, mono=arrived)
                    writer.event("http_out", rid=rid)
            await send(message)

        await self.app(scope, receive, timed_send)
