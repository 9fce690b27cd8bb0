"""Our router with experimental changes patched in at start, to measure what each suggested optimisation saves.

Nothing here is used by the router itself: these are prototypes for ``docs/performance.md``'s
suggestions, measured with ``python -m benchmarks.router_overhead --paths 'hybrid-pd,hybrid-pd[orjson]'``.

    python -m benchmarks.router_variants VARIANT[+VARIANT...] router --port ... (the ``hybrid-pd`` arguments)

Variants:

- ``asis``: unchanged.
- ``plain``: uvicorn on asyncio's loop and h11 (what a router-only install gets, since
  ``uvicorn`` without ``[standard]`` brings neither uvloop nor httptools).
- ``orjson``: orjson for the request body, the legs' bodies (httpx), the prefill answer,
  usage events and JSON answers.
- ``rawrelay``: relay the decode stream's bytes as they arrive (one write per network read,
  no text decoding or per-line work); only an event that carries a usage object is parsed
  and rewritten.
- ``aiohttp``: the legs through aiohttp (C HTTP parser, O(1) connection reuse) instead of
  httpx, behind a small adapter with the part of httpx's API the router uses.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

VARIANTS = ("asis", "plain", "orjson", "rawrelay", "aiohttp")


def _plain() -> None:
    import uvicorn

    uvicorn.run = functools.partial(uvicorn.run, loop="asyncio", http="h11")


def _orjson() -> None:
    import httpx._content
    import httpx._models
    import orjson
    from starlette.responses import JSONResponse

    import services.router.app as app

    class _Json:
        JSONDecodeError = json.JSONDecodeError  # orjson.JSONDecodeError subclasses it

        @staticmethod
        def loads(data: Any, **_: Any) -> Any:
            return orjson.loads(data)

        @staticmethod
        def dumps(obj: Any, **_: Any) -> str:
            return orjson.dumps(obj).decode()

    app.json = _Json  # type: ignore[assignment]
    httpx._models.jsonlib = _Json  # type: ignore[attr-defined]
    httpx._content.json_dumps = _Json.dumps  # type: ignore[attr-defined]
    JSONResponse.render = lambda self, content: orjson.dumps(content)  # type: ignore[method-assign]


def _rawrelay() -> None:
    import services.router.app as app
    from services.common.logs import kv
    from services.common.openai_errors import error_event
    from services.router.legs import merge_usage

    original = app._relay

    def rewrite_usage(events: bytes, prefill_usage: dict | None) -> bytes:
        out = []
        for event in events.split(b"\n\n"):
            if event.startswith(b"data: {") and b'"usage":{' in event:
                parsed = json.loads(event[6:])
                parsed["usage"] = merge_usage(prefill_usage, parsed["usage"])
                event = b"data: " + json.dumps(parsed, separators=(",", ":")).encode()
            out.append(event)
        return b"\n\n".join(out)

    async def relay(state: Any, routed: list, body: dict, arrived: float, route: str) -> AsyncIterator[bytes]:
        if len(routed) != 1:
            async for chunk in original(state, routed, body, arrived, route):
                yield chunk
            return
        r, metrics = routed[0], state.metrics
        first, last, outcome, pending = True, time.perf_counter(), "ok", b""
        try:
            try:
                async for chunk in r.response.aiter_raw():
                    pending += chunk
                    cut = pending.rfind(b"\n\n")
                    if cut < 0:
                        continue
                    ready, pending = pending[: cut + 2], pending[cut + 2 :]
                    if b'"usage":{' in ready:  # token events carry no usage (or "usage":null)
                        ready = rewrite_usage(ready, r.prefill_usage)
                    now = time.perf_counter()
                    if first:
                        metrics.ttft.observe(now - arrived)
                        first = False
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                    yield ready
            except (httpx.HTTPError, ValueError) as exc:
                outcome = "stream_error"
                app.log.warning("decode stream broke %s", kv(worker=r.decode.url, error=type(exc).__name__))
                yield error_event(502, f"decode worker failed mid-stream: {type(exc).__name__}")
                return
            if pending:
                yield pending
        except asyncio.CancelledError:
            outcome = "client_disconnected"
            raise
        finally:
            await app._close(r)
            metrics.requests.labels(route, outcome).inc()
            metrics.e2e.observe(time.perf_counter() - arrived)
            metrics.decode_leg.observe(time.perf_counter() - r.sent_at)

    app._relay = relay


class _AioResponse:
    """An aiohttp response that answers like the httpx.Response the router expects."""

    def __init__(self, response: Any, content: bytes | None = None) -> None:
        self._response = response
        self.status_code: int = response.status
        self.headers = response.headers
        self.content = content

    @property
    def text(self) -> str:
        return (self.content or b"").decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content or b"")

    async def aread(self) -> bytes:
        if self.content is None:
            self.content = await _mapped(self._response.read())
        return self.content

    async def aiter_lines(self) -> AsyncIterator[str]:
        try:
            async for line in self._response.content:
                yield line.decode().rstrip("\r\n")
        except Exception as exc:  # noqa: BLE001 - mapped to what the router catches
            raise _http_error(exc) from exc

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except Exception as exc:  # noqa: BLE001 - mapped to what the router catches
            raise _http_error(exc) from exc

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()  # drop the connection: the upstream sees the client leave and aborts


def _http_error(exc: BaseException) -> httpx.HTTPError:
    import aiohttp

    if isinstance(exc, httpx.HTTPError):
        return exc
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(exc))
    if isinstance(exc, asyncio.TimeoutError):
        return httpx.ReadTimeout(str(exc))
    return httpx.ReadError(f"{type(exc).__name__}: {exc}")


async def _mapped(awaitable: Any) -> Any:
    import aiohttp

    try:
        return await awaitable
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise _http_error(exc) from exc


class _AioClient:
    """The part of ``httpx.AsyncClient`` the router uses, on an aiohttp session."""

    def __init__(self, timeout: httpx.Timeout | None = None, **_: Any) -> None:
        self._timeout = timeout
        self._session: Any = None

    async def __aenter__(self) -> _AioClient:
        import aiohttp

        t = self._timeout
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect if t else None, sock_read=t.read if t else None)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    def build_request(self, method: str, url: str, json: Any = None, headers: dict | None = None) -> tuple:
        return method, url, json, headers

    async def send(self, request: tuple, stream: bool = False) -> _AioResponse:
        method, url, body, headers = request
        kwargs: dict[str, Any] = {"headers": headers}
        if body is not None:
            kwargs["data"] = _orjson_dumps(body)
            kwargs["headers"] = {**(headers or {}), "Content-Type": "application/json"}
        response = await _mapped(self._session.request(method, url, **kwargs))
        if stream:
            return _AioResponse(response)
        wrapped = _AioResponse(response, await _mapped(response.read()))
        response.release()
        return wrapped

    async def post(self, url: str, json: Any = None, headers: dict | None = None, **_: Any) -> _AioResponse:
        return await self.send(self.build_request("POST", url, json, headers))

    async def get(self, url: str, headers: dict | None = None, **_: Any) -> _AioResponse:
        return await self.send(self.build_request("GET", url, None, headers))


def _orjson_dumps(obj: Any) -> bytes:
    try:
        import orjson
    except ImportError:
        return json.dumps(obj, separators=(",", ":")).encode()
    return orjson.dumps(obj)


def _aiohttp() -> None:
    import types

    import services.router.app as app

    app.httpx = types.SimpleNamespace(**{**vars(httpx), "AsyncClient": _AioClient})  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit(__doc__)
    variants = args[0].split("+")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    for variant in variants:
        {"asis": lambda: None, "plain": _plain, "orjson": _orjson, "rawrelay": _rawrelay, "aiohttp": _aiohttp}[variant]()
    from services.cli import main as cli_main

    return cli_main(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
