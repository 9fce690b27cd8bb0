"""The router's /health tells the truth from its very first answer: 200 only once a request would be served.

A real router process in front of a worker that is still starting (``/health`` 503, as a vLLM
server loading its model is unreachable or not ready). Before the fix the router counted its
static workers healthy until a check said otherwise, so its first answers were 200 while
every request would have failed; probes (compose, Kubernetes) sent traffic ~85 s too early.
"""

from __future__ import annotations

import sys
import time

import httpx
from starlette.types import Receive, Scope, Send

from hybrid_pd.bench.router.fake_upstream import serve_in_thread
from hybrid_pd.common.processes import free_port, spawn, stop_group


class _StartingWorker:
    """A worker whose ``/health`` says 503 until ``ready`` is set."""

    def __init__(self) -> None:
        self.ready = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        status = 200 if self.ready or scope["path"] != "/health" else 503
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"object":"list","data":[]}'})


def _first_answer(client: httpx.Client, url: str, timeout_s: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.get(url)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_health_is_503_from_the_first_answer_until_a_decode_worker_has_answered_a_check(tmp_path):
    worker = _StartingWorker()
    with serve_in_thread(worker) as worker_url, httpx.Client(timeout=5) as client:
        port = free_port()
        argv = [sys.executable, "-m", "hybrid_pd.cli", "router", "--port", str(port), "--decode", worker_url, "--health-interval-s", "0.2"]
        router = spawn(argv, log=tmp_path / "router.log")
        try:
            health = f"http://127.0.0.1:{port}/health"
            first = _first_answer(client, health)
            assert first.json()["decode"] == [worker_url]  # our router, not another process on the port
            statuses = [first.status_code]
            until = time.monotonic() + 1.5  # several rounds of health checks that fail
            while time.monotonic() < until:
                statuses.append(client.get(health).status_code)
            assert set(statuses) == {503}, statuses
            r = client.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "hi"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            worker.ready = True
            deadline = time.monotonic() + 10
            while client.get(health).status_code != 200:
                assert time.monotonic() < deadline, "the router never admitted the worker"
                time.sleep(0.05)
            workers = client.get(f"http://127.0.0.1:{port}/health").json()
            assert workers["available"]["decode"] == [worker_url]
        finally:
            stop_group(router)
