"""The router's HTTP to its workers: ``httpx`` requests and answers on aiohttp's connection pool.

httpx's own transport (httpcore, anyio, h11) parses HTTP in Python and scans its
whole pool on every request, which cost the router most of its CPU per request
and grew with concurrency (``docs/performance.md``, "Router overhead"). aiohttp
parses in C and takes a pooled connection in O(1). :class:`Upstream` hands each
``httpx.Request`` straight to the transport: ``httpx.AsyncClient``'s layer (cookie
jar, URL merging, auth and redirect steps, event hooks) cost as much again as
aiohttp's whole work on both legs, and the router needs none of it. httpx's
request and answer types stay, so tests swap the network for ``httpx.MockTransport``
or any other ``httpx.AsyncBaseTransport``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Mapping

import aiohttp
import httpx
import yarl

__all__ = ["AiohttpTransport", "Upstream"]

# Workers' answers come back as they were sent: relayed bytes need no decoding, and a
# worker on the cluster network gains nothing from compressing each token event. Without
# it aiohttp would offer the encodings it can read, which httpx may not.
_HEADERS = {"Accept-Encoding": "identity"}
_JSON_HEADERS = {**_HEADERS, "Content-Type": "application/json"}


class Upstream:
    """Requests to workers, each handed as an ``httpx.Request`` straight to ``transport``.

    What ``httpx.AsyncClient`` would add and the router does not want is left out:
    no cookies are kept or sent, redirects are answers like any other, and there is
    no base URL, auth or event hooks. ``timeout`` applies to every request that names none.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout) -> None:
        self._transport = transport
        self._timeout = timeout.as_dict()

    async def request(
        self,
        method: str,
        url: str,
        *,
        json_body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """Send one request, with ``json_body`` (JSON, already encoded) as its body if given.

        The answer is read whole unless ``stream`` (then the caller closes it). Raises
        ``httpx.HTTPError`` (``httpx.TransportError`` from :class:`AiohttpTransport`) when the
        worker cannot be reached or its answer breaks off.
        """
        extensions = {"timeout": self._timeout if timeout is None else httpx.Timeout(timeout).as_dict()}
        target = _url(url)
        if json_body is None:
            request = httpx.Request(method, target, headers={**_HEADERS, **headers} if headers else _HEADERS, extensions=extensions)
        else:
            # What httpx's content= would do, at half its cost (it adds each header through setdefault):
            # the headers it adds written at once, the body read at once.
            fields = {**_JSON_HEADERS, **(headers or {}), "Host": _host(target), "Content-Length": str(len(json_body))}
            request = httpx.Request(method, target, headers=fields, stream=httpx.ByteStream(json_body), extensions=extensions)
            request.read()
        response = await self._transport.handle_async_request(request)
        response.request = request
        if not stream:
            try:
                await response.aread()  # closes the body once read
            except BaseException:
                await response.aclose()
                raise
        return response

    async def get(self, url: str, timeout: float | None = None) -> httpx.Response:
        """``GET url``, the answer read whole."""
        return await self.request("GET", url, timeout=timeout)

    async def aclose(self) -> None:
        """Close the transport and its connections."""
        await self._transport.aclose()

    async def __aenter__(self) -> Upstream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport that sends every request through one ``aiohttp.ClientSession``.

    The pool is unbounded. A connection idle for longer than ``keepalive_s`` is
    closed instead of reused: keep it below the workers' own keep-alive, or a
    request can go out on a connection the worker is closing at that moment.
    Each request's httpx ``connect`` and ``read`` timeouts apply; aiohttp follows
    no redirect, keeps no cookie and decodes nothing (``httpx.Response`` decodes
    what the headers say), and proxies from the environment are not used.
    aiohttp's errors come out as httpx's: ``ConnectError``, ``ConnectTimeout``,
    ``ReadTimeout``, ``ReadError``.
    """

    def __init__(self, keepalive_s: float) -> None:
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    def _pool(self) -> aiohttp.ClientSession:
        # Made on first use, not in __init__: aiohttp binds a session to the running loop,
        # and an app (or a test) may build its transport before any loop runs.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_s),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,  # httpx.Response decodes what the headers say, should a worker encode
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        content = await request.aread()
        try:
            response = await self._pool().request(
                request.method,
                yarl.URL(str(request.url), encoded=True),
                headers=request.headers.multi_items(),
                data=content or None,
                allow_redirects=False,
                timeout=_timeout(timeouts.get("connect"), timeouts.get("read")),
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _httpx_error(exc, request) from exc
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_Body(response, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode("latin-1")},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Body(httpx.AsyncByteStream):
    """A response body as aiohttp receives it, one network read per chunk."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _httpx_error(exc, self._request) from exc

    async def aclose(self) -> None:
        # aiohttp hands a connection back to the pool as soon as the answer has arrived whole,
        # so this only closes the connection of an answer cut short. That is how the worker
        # learns its client left: vLLM then aborts the request instead of generating on.
        self._response.close()


@functools.lru_cache(maxsize=256)
def _url(url: str) -> httpx.URL:
    # The router sends to a few worker URLs over and over: parse each once (httpx.URL is immutable).
    return httpx.URL(url)


@functools.lru_cache(maxsize=256)
def _host(url: httpx.URL) -> str:
    # The Host header httpx writes for a request to ``url``.
    return url.netloc.decode("ascii")


@functools.lru_cache(maxsize=16)
def _timeout(connect: float | None, read: float | None) -> aiohttp.ClientTimeout:
    # aiohttp's ``connect`` covers DNS and waiting for the pool, ``sock_connect`` the TCP
    # handshake; httpx's connect timeout means both. ``sock_read`` bounds each read, as httpx's read.
    return aiohttp.ClientTimeout(total=None, connect=connect, sock_connect=connect, sock_read=read)


def _httpx_error(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The httpx error for an aiohttp one, so callers catch ``httpx.HTTPError`` as before."""
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, (aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    return httpx.ReadError(message, request=request)
