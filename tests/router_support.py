"""Scripted workers and ASGI scaffolding shared by the router's tests (fixtures: tests/conftest.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from hybrid_pd.connector.contract import HANDOFF_PATH, HANDOFF_REACH_QUERY
from hybrid_pd.router.app import RouterApp, create_app
from hybrid_pd.router.registry import Worker
from hybrid_pd.router.settings import RouterSettings

PREFILL = "http://prefill.test:1"
DECODE = "http://decode.test:2"
KV = {"do_remote_prefill": True, "remote_block_ids": [[1], [2], [3]], "remote_engine_id": "e1", "remote_num_tokens": 4}


class Workers:
    """A scripted prefill and decode worker that records what they were sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, httpx.Headers]] = []
        self.prefill_response: httpx.Response | Exception = httpx.Response(
            200,
            json={
                "choices": [{"index": 0, "text": "PREFILL-TOKEN"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2}},
                "kv_transfer_params": KV,
            },
        )
        self.decode_stream: list[bytes] | None = None
        self.decode_breaks = False
        self.handoff = False  # whether they answer the early decode leg's probe (hybrid_pd/connector/vllm/handoff.py)
        self.inbox: str | None = None  # the decode engine's inbox the probe names (its scheduler holds early legs)
        self.reaches: bool | None = None  # the prefill's answer when asked whether it reaches an inbox (None: says nothing)
        self.reach_asked: list[str] = []  # the inboxes the prefill was asked of, in order

    def __call__(self, request: httpx.Request) -> httpx.Response:
        worker = "prefill" if request.url.host == "prefill.test" else "decode"
        if request.method == "GET":  # health checks and identity probes
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "root": f"/{worker}"}]})
            if request.url.path == HANDOFF_PATH:
                inbox = {"inbox": self.inbox} if self.inbox and worker == "decode" else {}
                if (asked := request.url.params.get(HANDOFF_REACH_QUERY)) is not None:
                    self.reach_asked.append(asked)
                    inbox = {"reaches": self.reaches} if self.reaches is not None else {}
                return httpx.Response(200 if self.handoff else 404, json={"handoff": 1, **inbox} if self.handoff else {})
            return httpx.Response(200, json={"version": "test"} if request.url.path == "/version" else {})
        body = json.loads(request.content) if request.content else {}
        self.calls.append((worker, body, request.headers))
        if worker == "prefill":
            if isinstance(self.prefill_response, Exception):
                raise self.prefill_response
            return self.prefill_response
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Stream(self.decode_stream or [], self.decode_breaks))
        return httpx.Response(
            200,
            json={
                "choices": [{"index": 0, "text": " decoded"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            },
        )


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], breaks: bool) -> None:
        self.chunks, self.breaks = chunks, breaks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.breaks:
            raise httpx.ReadError("connection reset by peer")


def router_app(handler: Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]], **settings: object) -> RouterApp:
    """A router in front of ``handler`` (the workers), with one prefill and one decode worker unless ``settings`` say otherwise."""
    return create_app(RouterSettings(**{"prefill": [PREFILL], "decode": [DECODE], **settings}), transport=httpx.MockTransport(handler))


def asgi_client(app: RouterApp) -> httpx.AsyncClient:
    """An HTTP client that calls ``app`` in process."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def scope(path: str) -> dict:
    """A POST to ``path`` as uvicorn sends it, spec version included: it decides how StreamingResponse watches the client."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"router"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def probed(app: RouterApp, known: Callable[[Worker], bool] = lambda w: w.identity.model is not None) -> None:
    """Wait for the health loop to have probed every static worker (it does so at start): ``known`` true of each."""
    for _ in range(200):
        if all(known(w) for w in app.state.router.registry.all()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the router never probed its workers")
