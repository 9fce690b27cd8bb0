"""The generation paths as plain ASGI: what FastAPI did for them (routing, errors, the body) still holds."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hybrid_pd.bench.router.fake_upstream import serve_in_thread
from tests.router_support import Workers, asgi_client, router_app, scope


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_other_methods_on_the_generation_paths_are_an_openai_405(client, workers, path, method):
    r = await client.request(method, path)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == f"{method} not allowed on {path}"
    assert workers.calls == []


@pytest.mark.parametrize("path", ["/v1/completion", "/v1/completions/x", "/v1/chat"])
async def test_paths_next_to_the_generation_paths_are_an_openai_404(client, path):
    r = await client.post(path, json={"prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


async def test_the_other_routes_are_still_served(client):
    assert (await client.get("/health")).status_code == 200
    assert (await client.post("/health")).status_code == 405
    assert "hybrid_pd_requests_total" in (await client.get("/metrics")).text


async def test_a_refusal_is_an_openai_error_with_the_request_id_and_is_counted(workers):
    app = router_app(workers, api_keys=["sk-1"])
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as c:
            r = await c.post("/v1/chat/completions", json={"messages": []}, headers={"X-Request-Id": "req-9", "Authorization": "Bearer no"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "req-9"
    assert r.headers["content-type"] == "application/json" and int(r.headers["content-length"]) == len(r.content)
    assert r.json()["error"]["type"] == "authentication_error"
    assert app.state.router.metrics.rejected.labels("401")._value.get() == 1
    assert workers.calls == []


async def test_the_router_at_its_concurrency_limit_is_429_with_retry_after(workers):
    app = router_app(workers, max_concurrency=1)
    async with app.router.lifespan_context(app):
        app.state.router.inflight = 1  # another request is being served
        async with asgi_client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and "concurrency limit" in r.json()["error"]["message"]
    assert app.state.router.inflight == 1, "a refused request changed the count of requests in flight"


class _Body:
    """A client that sends its body in ``parts``, then disconnects if ``then_leaves``.

    Otherwise it stays: like a server, its ``receive`` says ``http.disconnect`` once the answer is complete.
    """

    def __init__(self, parts: list[bytes], then_leaves: bool) -> None:
        self._messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
        if then_leaves:
            self._messages[-1]["more_body"] = True
            self._messages.append({"type": "http.disconnect"})
        self._complete = asyncio.Event()
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        if self._messages:
            return self._messages.pop(0)
        await self._complete.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self._complete.set()


async def _call(workers: Workers, client: _Body) -> object:
    app = router_app(workers, health_interval_s=3600)
    async with app.router.lifespan_context(app):
        await app(scope("/v1/completions"), client.receive, client.send)
    return app.state.router


async def test_a_body_sent_in_several_messages_is_read_whole(workers):
    raw = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
    client = _Body([raw[:5], raw[5:20], raw[20:]], then_leaves=False)
    await _call(workers, client)
    assert client.sent[0]["status"] == 200
    assert [w for w, _, _ in workers.calls] == ["prefill", "decode"] and workers.calls[1][1]["prompt"] == "hi"


async def test_a_client_leaving_while_it_sends_its_body_is_a_499_and_reaches_no_worker(workers):
    client = _Body([b'{"model": "m", "pro'], then_leaves=True)
    state = await _call(workers, client)
    assert client.sent[0]["status"] == 499 and workers.calls == []
    assert state.metrics.requests.labels("completions", "client_disconnected")._value.get() == 1 and state.inflight == 0


async def test_an_unexpected_error_is_an_openai_500_and_goes_on_to_the_server(workers):
    def broken_decode(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.host == "decode.test":
            return httpx.Response(200, content=b"not json")
        return workers(request)

    app = router_app(broken_decode)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "req-5"})
        with pytest.raises(json.JSONDecodeError):
            async with asgi_client(app) as c:
                await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and r.headers["x-request-id"] == "req-5"
    state = app.state.router
    assert state.inflight == 0 and [w.inflight for w in state.registry.all()] == [0, 0]


async def test_a_streamed_answer_is_one_start_then_body_messages_the_last_one_ending_it(workers):
    workers.decode_stream = [b'data: {"choices":[{"index":0,"text":" a"}]}\n\n', b"data: [DONE]\n\n"]
    raw = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()
    client = _Body([raw], then_leaves=False)
    state = await _call(workers, client)
    start, *bodies = client.sent
    assert start["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert all(m["type"] == "http.response.body" for m in bodies)
    assert [m.get("more_body") for m in bodies] == [True] * (len(bodies) - 1) + [False]
    assert b"".join(m["body"] for m in bodies).endswith(b"data: [DONE]\n\n")
    assert state.metrics.requests.labels("completions", "ok")._value.get() == 1 and state.inflight == 0


def test_a_client_sending_a_body_far_over_the_limit_reads_the_413(workers):
    """A real client sends all 30 MB, with a Content-Length or chunked: it reads the 413 (uvicorn drops the unread body)."""
    body = b'{"model": "m", "prompt": "' + b"x" * (30 * 1024 * 1024) + b'"}'
    with serve_in_thread(router_app(workers, max_body_bytes=1_000_000), lifespan="on") as url, httpx.Client(timeout=60) as client:
        for chunked in (False, True):  # with a Content-Length, and without one (read until over the limit)
            content = body if not chunked else iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
            r = client.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 413 and "larger than 1000000 bytes" in r.json()["error"]["message"]
    assert workers.calls == []
