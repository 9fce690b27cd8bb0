"""The router's HTTP to workers (``Upstream`` on ``AiohttpTransport``) against a raw HTTP/1.1 server on a real socket.

The server is scripted per test at the byte level, so each test controls exactly when
bytes arrive, when the connection stalls and when it drops.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from hybrid_pd.router.upstream import AiohttpTransport, Upstream

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[str]:
    """Serve ``handler`` (one call per connection) on a free local port; yields the base URL."""

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: some tests make it
        finally:
            writer.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """(request line, headers with lower-case names, body) of one request."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in head[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return head[0], headers, body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _client(timeout: httpx.Timeout | float = 5.0, keepalive_s: float = 2.0) -> Upstream:
    return Upstream(AiohttpTransport(keepalive_s=keepalive_s), httpx.Timeout(timeout))


async def test_request_and_answer_pass_through_unchanged_and_no_redirect_is_followed_nor_cookie_kept():
    seen: list[tuple[str, dict[str, str], bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            line, headers, body = await _read_request(reader)
            seen.append((line, headers, body))
            if line.startswith("GET /moved"):
                writer.write(b"HTTP/1.1 307 Temporary Redirect\r\nlocation: /elsewhere\r\ncontent-length: 0\r\n\r\n")
            else:
                answer = b'{"error": {"message": "no"}}'
                writer.write(b"HTTP/1.1 422 Unprocessable Entity\r\nx-worker: w1\r\nset-cookie: session=1\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()

    async with _server(handler) as url, _client() as client:
        r = await client.request("POST", url + "/v1/completions?a=1", json_body=b'{"prompt": [1, 2]}', headers={"X-Request-Id": "req-7"})
        assert (r.status_code, r.reason_phrase, r.headers["x-worker"]) == (422, "Unprocessable Entity", "w1")
        assert r.json() == {"error": {"message": "no"}}
        moved = await client.get(url + "/moved")
        assert moved.status_code == 307 and moved.headers["location"] == "/elsewhere"
    (line, headers, body), (moved_line, moved_headers, _) = seen
    assert line == "POST /v1/completions?a=1 HTTP/1.1" and moved_line == "GET /moved HTTP/1.1"
    assert headers["x-request-id"] == "req-7" and headers["content-type"] == "application/json"
    assert headers["accept-encoding"] == moved_headers["accept-encoding"] == "identity"
    assert "cookie" not in moved_headers, "a worker's cookie was sent back"
    assert json.loads(body) == {"prompt": [1, 2]} and int(headers["content-length"]) == len(body)
    assert len(seen) == 2, "the redirect was followed"


async def test_a_streamed_answer_arrives_chunk_by_chunk():
    rest_may_go = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_STREAM_HEAD + _chunk(b"data: 1\n\n"))
        await writer.drain()
        await rest_may_go.wait()
        writer.write(_chunk(b"data: 2\n\n") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with _server(handler) as url, _client() as client:
        response = await client.request("POST", url, json_body=b"{}", stream=True)
        chunks = response.aiter_bytes()
        assert await asyncio.wait_for(anext(chunks), 5) == b"data: 1\n\n", "the first event waited for the rest"
        rest_may_go.set()
        assert b"".join([chunk async for chunk in chunks]) == b"data: 2\n\ndata: [DONE]\n\n"
        await response.aclose()


async def test_closing_an_answer_before_its_end_drops_the_connection():
    disconnected = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(_STREAM_HEAD + _chunk(b"data: 1\n\n"))
        await writer.drain()
        assert await reader.read() == b""  # the worker's view: its client closed the connection
        disconnected.set()

    async with _server(handler) as url, _client() as client:
        response = await client.request("POST", url, json_body=b"{}", stream=True)
        assert await anext(response.aiter_bytes()) == b"data: 1\n\n"
        await response.aclose()
        await asyncio.wait_for(disconnected.wait(), 5)


async def _ports_of_two_requests(idle_s: float, keepalive_s: float) -> list[int]:
    """Client ports of two requests ``idle_s`` apart, each answer read to its end."""
    ports: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            await _read_request(reader)
            ports.append(writer.get_extra_info("peername")[1])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async with _server(handler) as url, _client(keepalive_s=keepalive_s) as client:
        for _ in range(2):
            assert (await client.get(url)).text == "ok"
            await asyncio.sleep(idle_s)
    return ports


async def test_a_connection_is_reused_within_the_keep_alive_and_dropped_after_it():
    reused = await _ports_of_two_requests(idle_s=0.05, keepalive_s=0.3)
    assert reused[0] == reused[1], "a connection read to its end was not reused"
    expired = await _ports_of_two_requests(idle_s=0.5, keepalive_s=0.3)
    assert expired[0] != expired[1], "a connection idle longer than the keep-alive was reused"


async def test_nothing_listening_is_a_connect_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    async with _client() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{port}/health")


async def test_a_worker_that_accepts_no_connection_is_a_connect_timeout():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepted: once the queue is full, the kernel drops further SYNs
        address = listener.getsockname()
        fillers = [socket.socket() for _ in range(3)]
        for filler in fillers:
            filler.setblocking(False)
            filler.connect_ex(address)
        try:
            async with _client(httpx.Timeout(5.0, connect=0.2)) as client:
                with pytest.raises(httpx.ConnectTimeout):
                    await client.get(f"http://127.0.0.1:{address[1]}/health")
        finally:
            for filler in fillers:
                filler.close()


@pytest.mark.parametrize("stalls", ["before_headers", "mid_body"])
async def test_a_worker_that_stops_sending_is_a_read_timeout(stalls: str):
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if stalls == "mid_body":
            writer.write(_STREAM_HEAD + _chunk(b"data: 1\n\n"))
            await writer.drain()
        await reader.read()  # until the client gives up

    async with _server(handler) as url, _client(httpx.Timeout(5.0, read=0.2)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.request("POST", url, json_body=b"{}")


async def test_a_timeout_given_with_the_request_replaces_the_default():
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # never answers

    async with _server(handler) as url, _client(httpx.Timeout(30.0)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await asyncio.wait_for(client.get(url + "/health", timeout=0.2), 10)


@pytest.mark.parametrize(
    "sent",
    [b"", b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789", _STREAM_HEAD + _chunk(b"data: 1\n\n")],
    ids=["no_answer", "short_body", "unfinished_stream"],
)
async def test_a_connection_dropped_before_the_answer_ends_is_a_read_error(sent: bytes):
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(sent)
        await writer.drain()  # then the connection closes

    async with _server(handler) as url, _client() as client:
        with pytest.raises(httpx.ReadError):
            await client.request("POST", url, json_body=b"{}")
