"""The early decode leg, worker side (issue #35): the decode server holds an early leg until the prefill's push.

Plain ASGI and a plain HTTP server here; the same parts inside real vLLM servers exchanging real
state are the e2e tests of the session stack (its router sends early legs by default).
"""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from urllib.parse import urlencode

import pytest

from hybrid_pd.connector.contract import HANDOFF_INBOX_ENV, HANDOFF_KEY_HEADER, HANDOFF_KEY_PARAM, HANDOFF_PATH, HANDOFF_REACH_QUERY
from hybrid_pd.connector.trace.timeline import REQUEST_ID_PARAM
from hybrid_pd.connector.vllm import handoff
from hybrid_pd.connector.vllm.handoff import HandoffMiddleware, Outbox

PUSHED = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1]], "remote_host": "h", "remote_port": 1}


class _App:
    """vLLM's app as the middleware sees it: records each request's body, answers 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        message = await receive()
        self.bodies.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _server_held(app: _App, writer: object = None) -> HandoffMiddleware:
    """The middleware on a vLLM whose engine client has no method to hold early legs in: the server holds them."""
    middleware = HandoffMiddleware(app, writer=writer, engine_client=_NoHoldEngineClient)
    assert not middleware.in_engine_client
    return middleware


class _NoHoldEngineClient:
    async def add_request(self, request: object) -> None: ...


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def event(self, name: str, **fields: object) -> None:
        self.seen.append((name, fields))


async def _call(
    middleware: HandoffMiddleware, method: str, path: str, body: bytes = b"", leave: asyncio.Event | None = None, early: bool = False,
    query: bytes = b"",
) -> tuple[int, bytes]:
    """One request through ``middleware``; ``leave``: when set, the client disconnects; ``early``: it says it is an early leg
    (the router's header)."""
    sent: list[dict] = []
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await (leave.wait() if leave is not None else asyncio.Event().wait())
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(HANDOFF_KEY_HEADER.encode(), b"k")] if early else []
    await middleware({"type": "http", "method": method, "path": path, "query_string": query, "headers": headers}, receive, send)
    if not sent:
        return 0, b""
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def _early_leg(key: str, rid: str = "r1") -> bytes:
    params = {"do_remote_prefill": True, HANDOFF_KEY_PARAM: key, REQUEST_ID_PARAM: rid}
    return json.dumps({"model": "m", "prompt": "hi", "stream": True, "kv_transfer_params": params}).encode()


def _push(*keys: str) -> bytes:
    return json.dumps([{"key": key, "params": PUSHED} for key in keys]).encode()


async def test_the_probe_says_the_worker_takes_part():
    assert await _call(_server_held(_App()), "GET", HANDOFF_PATH) == (200, b'{"handoff":1}')


async def test_a_push_that_came_first_goes_with_its_leg_into_vllm_once():
    app, events = _App(), _Events()
    middleware = _server_held(app, writer=events)
    assert await _call(middleware, "POST", HANDOFF_PATH, _push("k1")) == (204, b"")
    assert await _call(middleware, "POST", "/v1/completions", _early_leg("k1"), early=True) == (200, b"ok")
    sent = json.loads(app.bodies[0])
    assert sent["kv_transfer_params"] == {**PUSHED, HANDOFF_KEY_PARAM: "k1", REQUEST_ID_PARAM: "r1"}
    assert sent["prompt"] == "hi" and sent["stream"] is True
    assert events.seen == [("handoff_in", {"rid": "r1"})]
    # Taken once: a second leg with the same key waits (here: until its client leaves).
    leave = asyncio.Event()
    second = asyncio.ensure_future(_call(middleware, "POST", "/v1/completions", _early_leg("k1"), leave, early=True))
    await asyncio.sleep(0.05)
    leave.set()
    assert await second == (0, b"") and len(app.bodies) == 1


async def test_a_leg_that_came_first_waits_for_its_push_and_for_nothing_else():
    app = _App()
    middleware = _server_held(app)
    leg = asyncio.ensure_future(_call(middleware, "POST", "/v1/chat/completions", _early_leg("k2"), early=True))
    await asyncio.sleep(0.05)
    assert not leg.done() and app.bodies == []
    await _call(middleware, "POST", HANDOFF_PATH, _push("other"))
    await asyncio.sleep(0.05)
    assert not leg.done(), "another key's push does not release it"
    await _call(middleware, "POST", HANDOFF_PATH, _push("k2"))
    assert await asyncio.wait_for(leg, 5) == (200, b"ok")
    assert json.loads(app.bodies[0])["kv_transfer_params"]["remote_engine_id"] == "e1"


async def test_a_leg_whose_client_leaves_while_it_waits_never_reaches_vllm():
    app = _App()
    middleware = _server_held(app)
    leave = asyncio.Event()
    leg = asyncio.ensure_future(_call(middleware, "POST", "/v1/completions", _early_leg("k3"), leave, early=True))
    await asyncio.sleep(0.05)
    leave.set()
    assert await asyncio.wait_for(leg, 5) == (0, b"")
    assert app.bodies == [] and middleware._waiting == {}


async def test_a_leg_whose_push_never_comes_goes_on_without_parameters(monkeypatch, caplog):
    monkeypatch.setattr(handoff, "WAIT_LIMIT_S", 0.05)
    app = _App()
    with caplog.at_level(logging.WARNING, logger="vllm.hybrid_pd.handoff"):
        assert await _call(_server_held(app), "POST", "/v1/completions", _early_leg("k4"), early=True) == (200, b"ok")
    assert json.loads(app.bodies[0])["kv_transfer_params"] is None, "the decode worker computes the prompt itself"
    assert "no push came" in caplog.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", json.dumps({"prompt": "hi", "kv_transfer_params": {**PUSHED, HANDOFF_KEY_PARAM: "k"}}).encode()),
        ("/v1/completions", json.dumps({"prompt": f"a prompt that mentions {HANDOFF_KEY_PARAM}"}).encode()),
        ("/v1/completions", b"{not json " + HANDOFF_KEY_PARAM.encode()),
        ("/v1/embeddings", _early_leg("k5")),
    ],
    ids=["a-usual-decode-leg", "the-key-in-the-prompt", "malformed", "not-a-generation-path"],
)
async def test_anything_else_goes_to_vllm_as_it_came(path, body):
    app = _App()
    assert await asyncio.wait_for(_call(_server_held(app), "POST", path, body), 5) == (200, b"ok")
    assert app.bodies == [body]


async def test_a_request_that_does_not_say_it_is_an_early_leg_is_not_read_on_its_way():
    """Only the router's header makes the middleware read a body: every other request reaches vLLM with the connection's own
    receive (nothing buffered or replayed), an early leg's body included (the header is the leg's word)."""
    seen = []

    async def app(scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        seen.append(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    bodies = [{"type": "http.request", "body": _early_leg("k6"), "more_body": False}]

    async def receive() -> dict:
        if bodies:  # the body once; then the connection stays open
            return bodies.pop()
        await asyncio.Event().wait()

    async def send(message: dict) -> None:
        pass

    await asyncio.wait_for(_server_held(app)({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send), 5)
    assert seen == [receive]


async def test_one_post_brings_several_pushes():
    app = _App()
    middleware = _server_held(app)
    assert await _call(middleware, "POST", HANDOFF_PATH, _push("x", "y")) == (204, b"")
    for key in ("y", "x"):
        assert await asyncio.wait_for(_call(middleware, "POST", "/v1/completions", _early_leg(key), early=True), 5) == (200, b"ok")
    assert [json.loads(b)["kv_transfer_params"][HANDOFF_KEY_PARAM] for b in app.bodies] == ["y", "x"]


@pytest.mark.parametrize(
    "body", [b"{not json", json.dumps({"key": "k", "params": {}}).encode(), json.dumps([{"key": 1, "params": {}}]).encode(), json.dumps([{"key": "k"}]).encode()]
)
async def test_a_malformed_push_is_a_400(body):
    status, answer = await _call(_server_held(_App()), "POST", HANDOFF_PATH, body)
    assert status == 400 and b"error" in answer


async def test_asked_the_probe_says_whether_this_host_reaches_a_peers_inbox(unused_tcp_port):
    listening = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    middleware = _server_held(_App())
    async with listening:
        for inbox, reaches in ((f"tcp://127.0.0.1:{port}", b"true"), (f"tcp://127.0.0.1:{unused_tcp_port}", b"false")):
            query = urlencode({HANDOFF_REACH_QUERY: inbox}).encode()
            assert await _call(middleware, "GET", HANDOFF_PATH, query=query) == (200, b'{"handoff":1,"reaches":' + reaches + b"}")
    for bad in ("http://127.0.0.1:80", "tcp://127.0.0.1", "tcp://:80", "tcp://h:x"):
        status, answer = await _call(middleware, "GET", HANDOFF_PATH, query=urlencode({HANDOFF_REACH_QUERY: bad}).encode())
        assert status == 400 and b"tcp://host:port" in answer, bad


async def test_where_the_engine_takes_the_pushes_one_posted_to_the_server_goes_on_to_it(monkeypatch, unused_tcp_port):
    """A decode worker whose scheduler holds early legs (scheduler_hold) relays a push POSTed to its server (the router's choice
    while the prefill is not known to reach the inbox: hybrid_pd/router/inbox_reach.py) to its engine's inbox on this host,
    whatever host the inbox's address names."""
    zmq = pytest.importorskip("zmq")
    inbox = zmq.Context.instance().socket(zmq.PULL)
    inbox.bind(f"tcp://127.0.0.1:{unused_tcp_port}")
    monkeypatch.setenv(HANDOFF_INBOX_ENV, f"tcp://decode.example:{unused_tcp_port}")
    try:
        middleware = HandoffMiddleware(_App())
        assert await _call(middleware, "GET", HANDOFF_PATH) == (200, json.dumps({"handoff": 1, "inbox": f"tcp://decode.example:{unused_tcp_port}"},
                                                                                separators=(",", ":")).encode())  # fmt: skip
        assert await _call(middleware, "POST", HANDOFF_PATH, _push("x", "y")) == (204, b"")
        assert inbox.poll(5000), "nothing reached the engine's inbox"
        batch = json.loads(inbox.recv())  # the POST's batch, one message
        assert [p["key"] for p in batch] == ["x", "y"] and all(p["params"] == PUSHED for p in batch)
    finally:
        inbox.close(linger=0)


class _Server:
    """A plain HTTP server that records what is POSTed to it and answers 204 once ``answering`` is set, as a decode worker's server does."""

    def __init__(self) -> None:
        self.received: list[tuple[str, list]] = []
        self.answering = threading.Event()
        self.answering.set()


@pytest.fixture
def server() -> Iterator[tuple[str, _Server]]:
    state = _Server()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            state.received.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            state.answering.wait(10)
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    state.answering.set()
    httpd.shutdown()


def _wait_for(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_outbox_posts_every_push_to_the_decode_workers_server_in_order(server):
    url, state = server
    received = state.received
    outbox = Outbox()
    for key in ("a", "b", "c"):
        outbox.push(url, key, PUSHED)
    _wait_for(lambda: sum(len(batch) for _, batch in received) == 3)
    assert all(path == HANDOFF_PATH for path, _ in received)
    assert [push for _, batch in received for push in batch] == [{"key": k, "params": PUSHED} for k in ("a", "b", "c")]


def test_pushes_that_queue_while_a_post_is_out_go_in_the_next_post_together(server):
    url, state = server
    received = state.received
    outbox = Outbox()
    state.answering.clear()  # the decode server is slow to answer the first POST
    outbox.push(url, "first", PUSHED)
    _wait_for(lambda: len(received) == 1)
    for key in ("b", "c", "d"):  # meanwhile a prefill step ends three more prompts
        outbox.push(url, key, PUSHED)
    state.answering.set()
    _wait_for(lambda: sum(len(batch) for _, batch in received) == 4)
    assert [[p["key"] for p in batch] for _, batch in received] == [["first"], ["b", "c", "d"]]


def test_a_push_that_cannot_be_delivered_is_logged(caplog, unused_tcp_port):
    outbox = Outbox()
    with caplog.at_level(logging.WARNING, logger="vllm.hybrid_pd.handoff"):
        outbox.push(f"http://127.0.0.1:{unused_tcp_port}", "k", PUSHED)
        _wait_for(lambda: "hand-off of 1 to" in caplog.text)
    assert "ConnectionRefusedError" in caplog.text


# --- held in vLLM's engine client --------------------------------------------------------------------------------------


def _engine_client() -> type:
    """vLLM's ``AsyncLLM`` as the hold sees it (a class of its own per test: the hold wraps the class's method)."""

    class EngineClient:
        def __init__(self) -> None:
            self.added: list[object] = []  # each request's kv_transfer_params as they reached the engine core
            self.rejected: list[object] = []  # ... and each refused or cancelled request's, as vLLM notifies its connector

        async def _add_request(self, request, prompt, parent_req, index, queue):  # noqa: ANN001 - vLLM's signature
            self.added.append(request.sampling_params.extra_args.get("kv_transfer_params"))

        async def notify_kv_transfer_request_rejected(self, request_id, kv_transfer_params, *, data_parallel_rank=None):  # noqa: ANN001
            self.rejected.append(kv_transfer_params)

    return EngineClient


def _engine_request(params: dict) -> SimpleNamespace:
    """An ``EngineCoreRequest`` as vLLM makes it of a request: the leg's kv_transfer_params in its sampling params' extra_args."""
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": dict(params)}))


def _leg_params(key: str, rid: str = "r1") -> dict:
    return json.loads(_early_leg(key, rid))["kv_transfer_params"]


async def test_in_the_engine_client_an_early_leg_is_rendered_during_the_prefill_and_only_the_request_waits():
    """The server passes the leg on unread, so vLLM parses and renders it at once; the engine client holds the ready request
    until its push, then sends it on with the pushed parameters, once; the timeline has the push's arrival and the release."""
    app, events, client = _App(), _Events(), _engine_client()
    middleware = HandoffMiddleware(app, writer=events, engine_client=client)
    assert middleware.in_engine_client
    assert await _call(middleware, "POST", "/v1/completions", _early_leg("k1"), early=True) == (200, b"ok")
    assert app.bodies == [_early_leg("k1")]  # on to vLLM at once, as it came
    engine = client()
    added = asyncio.ensure_future(engine._add_request(_engine_request(_leg_params("k1")), "hi", None, 0, None))
    await asyncio.sleep(0.05)
    assert not added.done() and engine.added == []
    assert await _call(middleware, "POST", HANDOFF_PATH, _push("k1")) == (204, b"")
    await asyncio.wait_for(added, 5)
    assert engine.added == [{**PUSHED, HANDOFF_KEY_PARAM: "k1", REQUEST_ID_PARAM: "r1"}]
    (pushed, at), (released, _) = events.seen
    assert (pushed, released, at["rid"]) == ("handoff_in", "handoff_released", "r1") and isinstance(at["mono"], float)
    # a push that came first: the request goes on at once; any other request (a prefill leg names a key too) untouched
    await _call(middleware, "POST", HANDOFF_PATH, _push("k2"))
    prefill = {"do_remote_decode": True, "do_remote_prefill": False, HANDOFF_KEY_PARAM: "k3", "hybrid_pd_handoff_url": "http://d"}
    for params in (_leg_params("k2"), prefill, {"do_remote_prefill": True, **PUSHED}):
        await asyncio.wait_for(engine._add_request(_engine_request(params), "hi", None, 0, None), 5)
    assert engine.added[1:] == [{**PUSHED, HANDOFF_KEY_PARAM: "k2", REQUEST_ID_PARAM: "r1"}, prefill, {"do_remote_prefill": True, **PUSHED}]


async def test_in_the_engine_client_a_leg_whose_client_leaves_never_reaches_the_engine_and_one_without_a_push_computes_itself(
    monkeypatch, caplog
):
    client = _engine_client()
    middleware = HandoffMiddleware(_App(), engine_client=client)
    engine = client()
    added = asyncio.ensure_future(engine._add_request(_engine_request(_leg_params("k4")), "hi", None, 0, None))
    await asyncio.sleep(0.05)
    added.cancel()  # vLLM cancels the request's task when its client disconnects
    with pytest.raises(asyncio.CancelledError):
        await added
    assert engine.added == [] and middleware._waiting == {}
    monkeypatch.setattr(handoff, "WAIT_LIMIT_S", 0.1)
    with caplog.at_level(logging.WARNING, logger="vllm.hybrid_pd.handoff"):
        await asyncio.wait_for(engine._add_request(_engine_request(_leg_params("k5")), "hi", None, 0, None), 5)
    assert engine.added == [None] and "no push came" in caplog.text  # no parameters: the decode worker computes the prompt


async def test_a_held_leg_that_vllm_refuses_or_whose_client_leaves_frees_the_prefills_blocks_once_pushed_and_kills_no_engine(monkeypatch):
    """vLLM notifies its connector of a refused request (max_tokens -5) or one cancelled before it was added, with the
    request's parameters. A held leg's did not yet say where the prefill's blocks are, and vLLM 0.32's NIXL scheduler died on
    them (KeyError 'remote_block_ids', the session stack's decode engine down for every test after the bad-input one): the
    notice waits for the push and goes with its parameters; with no push, none goes."""
    client = _engine_client()
    middleware = HandoffMiddleware(_App(), engine_client=client)
    engine = client()
    notice = asyncio.ensure_future(engine.notify_kv_transfer_request_rejected("r1", _leg_params("k6"), data_parallel_rank=None))
    await asyncio.sleep(0.05)
    assert not notice.done() and engine.rejected == []
    await _call(middleware, "POST", HANDOFF_PATH, _push("k6"))
    await asyncio.wait_for(notice, 5)
    assert engine.rejected == [{**PUSHED, HANDOFF_KEY_PARAM: "k6", REQUEST_ID_PARAM: "r1"}]
    await engine.notify_kv_transfer_request_rejected("r2", {"do_remote_prefill": True, **PUSHED})  # a usual decode leg's: at once
    monkeypatch.setattr(handoff, "WAIT_LIMIT_S", 0.1)
    await asyncio.wait_for(engine.notify_kv_transfer_request_rejected("r3", _leg_params("k7")), 5)
    assert engine.rejected[1:] == [{"do_remote_prefill": True, **PUSHED}]  # k7: no push, no notice


def test_a_worker_told_to_hold_early_legs_in_the_server_does(monkeypatch):
    monkeypatch.setenv(handoff.EARLY_LEG_HOLD_ENV, "server")
    client = _engine_client()
    original = client._add_request
    assert not HandoffMiddleware(_App(), engine_client=client).in_engine_client and client._add_request is original


def test_the_hold_wraps_only_the_engine_client_method_it_was_checked_with_and_only_once():
    class Other:
        async def _add_request(self, request, prompt):  # noqa: ANN001 - another vLLM's signature
            ...

    class NoNotice:  # the hold alone, without its refused requests' notice, would leave vLLM the held parameters
        async def _add_request(self, request, prompt, parent_req, index, queue):  # noqa: ANN001
            ...

    for engine_client in (Other, NoNotice):
        original = engine_client._add_request
        assert not HandoffMiddleware(_App(), engine_client=engine_client).in_engine_client and engine_client._add_request is original
    client = _engine_client()
    original = client._add_request
    HandoffMiddleware(_App(), engine_client=client)
    HandoffMiddleware(_App(), engine_client=client)  # a second server app in the process: the original wrapped once
    assert client._add_request.__wrapped_by_hybrid_pd__ is original
