"""A client that leaves: the router stops its legs (vLLM then aborts) and frees what they held.

The app is called as an ASGI server calls it, so each test decides when the client's
``http.disconnect`` arrives; the workers are scripted behind ``httpx.MockTransport``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.router.disconnect import cancel_on_disconnect
from tests.router_support import KV, router_app, scope

TOKEN = b'data: {"choices":[{"index":0,"text":" a"}]}\n\n'


class _Client:
    """One client connection: sends ``body``, records what comes back, disconnects when told to."""

    def __init__(self, body: dict) -> None:
        self._body = json.dumps(body).encode()
        self._sent_body = False
        self.leave = asyncio.Event()
        self.messages: list[dict] = []
        self.first_chunk = asyncio.Event()

    async def receive(self) -> dict:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.messages.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.first_chunk.set()

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.messages if m["type"] == "http.response.start"), None)


class _Decode:
    """A decode worker that never finishes: it blocks before its headers, or after one streamed event.

    Records whether the router cancelled the leg (the connection closing, for vLLM) or closed the stream.
    """

    def __init__(self, stalls: str) -> None:
        self.stalls = stalls
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.stream_closed = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # health checks and identity probes
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.host == "prefill.test":
            return httpx.Response(200, json={"choices": [], "usage": {"prompt_tokens": 1}, "kv_transfer_params": KV})
        self.started.set()
        if self.stalls == "before_headers":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_EndlessStream(self))


class _EndlessStream(httpx.AsyncByteStream):
    def __init__(self, decode: _Decode) -> None:
        self._decode = decode

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield TOKEN
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self._decode.stream_closed.set()


async def _serve_until_the_client_leaves(decode: _Decode, body: dict, leave_on: str) -> tuple[_Client, object]:
    app = router_app(decode, health_interval_s=3600)
    client = _Client(body)
    async with app.router.lifespan_context(app):
        call = asyncio.ensure_future(app(scope("/v1/completions"), client.receive, client.send))
        await asyncio.wait_for((decode.started if leave_on == "decode_started" else client.first_chunk).wait(), 5)
        client.leave.set()
        await _finishes(call)
    return client, app.state.router


async def _finishes(task: asyncio.Future, within_s: float = 5) -> None:
    """Wait for ``task``; fail (and stop it) if it is still going ``within_s`` after the client left."""
    done, _ = await asyncio.wait({task}, timeout=within_s)
    if not done:
        task.cancel()
        pytest.fail("still working for a client that left")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_client_leaving_while_the_decode_worker_works_cancels_the_leg_and_frees_its_lease(stream):
    decode = _Decode(stalls="before_headers")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 500, "stream": stream}
    client, state = await _serve_until_the_client_leaves(decode, body, leave_on="decode_started")
    assert decode.cancelled.is_set(), "the decode leg went on after the client left"
    assert client.status == 499
    assert [w.inflight for w in state.registry.all()] == [0, 0] and state.inflight == 0
    assert state.metrics.requests.labels("completions", "client_disconnected")._value.get() == 1


async def test_a_client_leaving_mid_stream_closes_the_decode_stream_and_frees_its_lease():
    decode = _Decode(stalls="mid_stream")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 500, "stream": True}
    client, state = await _serve_until_the_client_leaves(decode, body, leave_on="first_chunk")
    assert decode.stream_closed.is_set(), "the decode stream stayed open after the client left"
    assert client.status == 200 and client.messages[1]["body"] == TOKEN
    assert [w.inflight for w in state.registry.all()] == [0, 0] and state.inflight == 0
    assert state.metrics.requests.labels("completions", "client_disconnected")._value.get() == 1


def _receive(disconnect: asyncio.Event):
    async def receive() -> dict:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    return receive


async def test_the_block_runs_to_its_end_while_the_client_stays_and_nothing_is_left_waiting():
    before = asyncio.all_tasks()
    async with cancel_on_disconnect(_receive(asyncio.Event())):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)  # the watcher's cancellation is delivered
    assert asyncio.all_tasks() == before


async def test_a_disconnect_cancels_the_block_and_becomes_a_499():
    disconnect = asyncio.Event()
    reached: list[str] = []

    async def work() -> None:
        async with cancel_on_disconnect(_receive(disconnect)):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                reached.append("cancelled")
                raise
            reached.append("finished")

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0.01)
    disconnect.set()
    await _finishes(task)
    with pytest.raises(OpenAIError) as error:
        task.result()
    assert error.value.status == 499 and reached == ["cancelled"]
    assert task.cancelling() == 0, "the task still counts our cancellation"


@pytest.mark.parametrize("client_leaves_too", [False, True])
async def test_a_cancellation_from_elsewhere_goes_through_as_a_cancellation(client_leaves_too):
    disconnect = asyncio.Event()

    async def work() -> None:
        async with cancel_on_disconnect(_receive(disconnect)):
            asyncio.current_task().cancel()  # the server shutting down, say
            if client_leaves_too:
                disconnect.set()  # at the same moment: the watcher cancels the task a second time
            await asyncio.sleep(30)

    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(work())
