"""The router's connections to workers, over real sockets (a scripted worker served by uvicorn)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from hybrid_pd.bench.router.fake_upstream import serve_in_thread
from hybrid_pd.router.app import create_app
from hybrid_pd.router.settings import RouterSettings


class _Decode:
    """An ASGI decode worker that records the method and client port of every request (health checks too)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int]] = []

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.requests.append((scope["method"], scope["client"][1]))
        body = b'{"choices": [{"index": 0, "text": " ok"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def decode() -> Iterator[tuple[str, _Decode]]:
    app = _Decode()
    with serve_in_thread(app, timeout_keep_alive=30) as url:
        yield url, app


async def _two_requests_apart(url: str, idle_s: float, **settings) -> None:
    app = create_app(RouterSettings(decode=[url], health_interval_s=3600, **settings))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            for _ in range(2):
                r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
                assert r.status_code == 200, r.text
                await asyncio.sleep(idle_s)


def _second_completion_reused_a_connection(worker: _Decode) -> bool:
    """Whether the second completion went out on a connection an earlier request (completion or health check) used."""
    second = [i for i, (method, _) in enumerate(worker.requests) if method == "POST"][1]
    return worker.requests[second][1] in {port for _, port in worker.requests[:second]}


async def test_idle_worker_connections_are_dropped_before_the_workers_keep_alive_ends(decode):
    url, worker = decode
    # Wide margins both ways: a loaded machine may delay the second request by a few hundred ms.
    await _two_requests_apart(url, idle_s=2.5, upstream_keepalive_s=1.0)
    assert not _second_completion_reused_a_connection(worker), "a connection idle longer than upstream_keepalive_s was reused"
    worker.requests.clear()
    await _two_requests_apart(url, idle_s=0.05, upstream_keepalive_s=1.0)
    assert _second_completion_reused_a_connection(worker), "a recently used connection was not reused"
