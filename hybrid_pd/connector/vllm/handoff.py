"""The early decode leg: the prefill's engine pushes the state's whereabouts straight to the decode worker.

Why: a split request's first token waited for two request paths one after the other. The
router sent the decode leg only once the prefill's whole HTTP answer was back: 25.7 ms from the
decode leg's send to its first byte at 1,000 prompt tokens and 32.8 ms at 8,000 on an H100
(Nemotron-H-8B, vLLM 0.26), for one transfer and one decode step. Now the router sends both legs
at once (``hybrid_pd/router/route.py``): the decode leg's HTTP hop is done while the prefill
computes, and the prefill's parameters (``kv_transfer_params``: where the blocks are) reach the
decode worker from the prefill's engine the moment the prefill ends, not through the prefill's
answer path, the router and a second request.

Two parts, one per process they run in:

- :class:`Outbox`, the prefill's engine (scheduler side of our connector): when a request whose
  prefill leg names a hand-off (:data:`HANDOFF_URL_PARAM`, :data:`HANDOFF_KEY_PARAM`) ends, its
  parameters are POSTed to the decode worker's vLLM server by a thread per decode worker, so the
  engine's loop never waits on the network.
- :class:`HandoffMiddleware`, every P/D worker's vLLM server (plain ASGI, vLLM's ``--middleware``):
  ``GET`` :data:`HANDOFF_PATH` answers 200 (the router's probe: this worker takes part); a ``POST``
  brings pushes (a JSON list of ``{"key", "params"}``). An early leg (a generation request whose
  parameters name a key and a remote prefill not yet located) waits for its key's push, then goes
  on with the pushed parameters, as the usual decode leg would. Where it waits:

  - **in vLLM's engine client** (``AsyncLLM._add_request``, wrapped where vLLM has it as 0.26 and
    0.32 do: :func:`hold_in_engine_client`): vLLM parses the leg, renders and tokenizes its prompt
    while the prefill runs, and only the request, ready, waits for the push. On one H100 (vLLM
    0.26, Nemotron-H-8B) that work cost 2.9 ms at 1,000 prompt tokens and 5.7 ms at 8,000 after
    the push when the leg waited in the server;
  - else **in the server**, before vLLM reads it (the request with the router's
    :data:`HANDOFF_KEY_HEADER`): any other request goes on to vLLM as it came, its body unread;
  - or, chosen (``--early-leg-hold scheduler``), **in vLLM's scheduler**, the push sent by the prefill's engine
    straight to the decode engine's inbox, not to this server (:mod:`hybrid_pd.connector.vllm.scheduler_hold`):
    here the probe names that inbox and nothing is held; a push POSTed here all the same (the router's choice while
    the prefill worker is not known to reach the inbox: :mod:`hybrid_pd.router.inbox_reach`) is relayed to it.

Every P/D worker's server also answers the router's question whether its host reaches a peer's inbox
(``GET`` :data:`HANDOFF_PATH` ``?reach=tcp://host:port``): a connection opened and closed, nothing sent.

Why the request waits before the engine by default and not in it: a request waiting in vLLM's
scheduler (its connector answering "ask again later") makes the engine step its model workers every
millisecond for as long as the prefill runs (on the 2-core CPU machine, when the stack pinned a
prefill and a decode worker to one core, that starved the prefill's model worker into a 60 s stall,
issue #36). Held before the engine core, the decode worker does nothing until the state exists.
Held in the scheduler (``--early-leg-hold scheduler``), it pays that CPU for the hops it saves.

What can go wrong stays correct: a prefill that fails or refuses is the router's to handle (it
closes the early leg, which never reached vLLM, and goes on as before); a push that never comes
leaves the early leg waiting :data:`WAIT_LIMIT_S` at most, then it goes on without parameters and
the decode worker computes the prompt itself. A server started with several API processes
(``--api-server-count``) could take a push in one process for a leg held in another; our launch
starts one, and installs this middleware only then.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import inspect
import json
import logging
import os
import queue
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from hybrid_pd.connector.contract import (
    EARLY_LEG_HOLD_ENV,
    HANDOFF_INBOX_ENV,
    HANDOFF_KEY_HEADER,
    HANDOFF_KEY_PARAM,
    HANDOFF_PATH,
    HANDOFF_REACH_QUERY,
)
from hybrid_pd.connector.trace.timeline import REQUEST_ID_PARAM, TimelineWriter
from hybrid_pd.connector.trace.timeline import from_env as timeline_from_env
from hybrid_pd.connector.vllm.pushes import Arrivals, held_key, parse_pushes

__all__ = ["HandoffMiddleware", "Outbox", "WAIT_LIMIT_S", "hold_in_engine_client"]

log = logging.getLogger("vllm.hybrid_pd.handoff")

# The longest an early leg waits for its push before the decode worker computes the prompt itself.
# Not a latency bound: a prefill queued behind others under load can take tens of seconds.
WAIT_LIMIT_S = 120.0
_POST_TIMEOUT_S = 5.0
# How long the reach check waits for a peer's inbox to accept a connection: a closed port refuses at once; a dropped
# one (a firewall) says nothing, and the router's own wait for the answer is longer than this.
REACH_TIMEOUT_S = 2.0


class Outbox:
    """Prefill engine: hand-offs POSTed to decode workers' servers, by a daemon thread per decode worker.

    A thread sends whatever has queued for its worker in one POST (a JSON list): a prefill step
    ends several prompts at once, and a wave of them must not wait one round trip each on a decode
    server that is busy streaming; a slow decode worker delays only its own.
    """

    def __init__(self) -> None:
        self._queues: dict[str, queue.SimpleQueue[dict[str, Any]]] = {}
        self._sockets: dict[str, Any] = {}  # zmq PUSH sockets, by decode engine inbox (tcp://host:port)

    def push(self, url: str, key: str, params: dict[str, Any]) -> None:
        """Send ``params`` for the early leg ``key`` to the decode worker at ``url`` (its server's http(s) URL, or its engine's
        inbox, ``tcp://host:port``: :mod:`hybrid_pd.connector.vllm.scheduler_hold`); returns at once."""
        if url.startswith("tcp://"):
            self.push_to_engine(url, [(key, params)])
            return
        pending = self._queues.get(url)
        if pending is None:
            pending = self._queues[url] = queue.SimpleQueue()
            threading.Thread(target=_send_forever, args=(url, pending), name="hybrid-pd-handoff", daemon=True).start()
        pending.put({"key": key, "params": params})

    def push_to_engine(self, url: str, pushes: list[tuple[str, dict[str, Any]]]) -> None:
        """``pushes`` (key, parameters) in one message over ZMQ to the decode engine's inbox at ``url``, from this thread: a
        send that does not block (ZMQ's own thread moves it; it queues while the peer connects); dropped, with a warning,
        where that queue is full (a decode worker long gone)."""
        import zmq

        socket = self._sockets.get(url)
        if socket is None:
            socket = self._sockets[url] = zmq.Context.instance().socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(url)
        try:
            socket.send(json.dumps([{"key": key, "params": params} for key, params in pushes]).encode(), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("hand-off of %d to %s dropped (its queue is full): that decode worker computes those prompts itself "
                        "after %.0f s", len(pushes), url, WAIT_LIMIT_S)


def _send_forever(url: str, pending: queue.SimpleQueue[dict[str, Any]]) -> None:
    """POST each batch of ``pending`` pushes to ``url``'s server, over one kept-alive connection (a fresh one if it was closed)."""
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = None
    while True:
        batch = [pending.get()]
        with contextlib.suppress(queue.Empty):
            while True:
                batch.append(pending.get_nowait())
        body, status = json.dumps(batch).encode(), None
        for _ in range(2):
            connection = connection or kind(parts.netloc, timeout=_POST_TIMEOUT_S)
            try:
                connection.request("POST", parts.path.rstrip("/") + HANDOFF_PATH, body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()
                status = response.status
                break
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                connection, status = None, f"{type(exc).__name__}: {exc}"
        if status != 204:
            log.warning("hand-off of %d to %s failed (%s): that decode worker computes those prompts itself after %.0f s",
                        len(batch), url, status, WAIT_LIMIT_S)


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_KEY_HEADER = HANDOFF_KEY_HEADER.encode()


class HandoffMiddleware:
    """A P/D worker's vLLM server: answers the router's probe, takes pushes, holds early legs until theirs comes (in vLLM's
    engine client where it can, else here)."""

    def __init__(self, app: ASGIApp, writer: TimelineWriter | None = None, engine_client: type | None = None) -> None:
        """``engine_client``: the class whose ``_add_request`` holds early legs (default: vLLM's ``AsyncLLM``)."""
        self.app = app
        self.writer = writer if writer is not None else timeline_from_env()
        self._arrived = Arrivals()
        self._waiting: dict[str, asyncio.Event] = {}  # early legs held, by key
        # Held in vLLM's scheduler (scheduler_hold): the engine's inbox, which the probe names; nothing is held here, and
        # pushes POSTed here go on to the engine on this host.
        self.inbox = os.environ.get(HANDOFF_INBOX_ENV)
        self._relay = (Outbox(), f"tcp://127.0.0.1:{urlsplit(self.inbox).port}") if self.inbox else None
        self.in_engine_client = (self.inbox is None and os.environ.get(EARLY_LEG_HOLD_ENV) != "server"
                                 and hold_in_engine_client(self, engine_client))  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "POST"):
            await self.app(scope, receive, send)
        elif scope["path"] == HANDOFF_PATH:
            await self._handoff(scope, receive, send)
        elif (not self.in_engine_client and self.inbox is None and scope["method"] == "POST" and scope["path"] in _GENERATION_PATHS
              and any(k == _KEY_HEADER for k, _ in scope["headers"])):  # fmt: skip
            await self._generation(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def release(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """An early leg's parameters once its push came (held and pushed merged), as vLLM's engine client holds it; None when
        none came in :data:`WAIT_LIMIT_S` (the decode worker computes the prompt). The caller's cancellation (the client
        left) ends the wait: nothing reached the engine."""
        key = params[HANDOFF_KEY_PARAM]
        pushed = await self._pushed(key, None)
        if not isinstance(pushed, tuple):
            log.warning("early leg %s: no push came in %.0f s; the prompt is computed here", key, WAIT_LIMIT_S)
            return None
        pushed_at, pushed_params = pushed
        if self.writer is not None and isinstance(params.get(REQUEST_ID_PARAM), str):  # the push's arrival, then the release
            self.writer.event("handoff_in", rid=params[REQUEST_ID_PARAM], mono=pushed_at)
            self.writer.event("handoff_released", rid=params[REQUEST_ID_PARAM])
        return {**params, **pushed_params}

    async def _handoff(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] == "GET":
            await self._probe(scope, send)
            return
        pushes = parse_pushes(await _body(receive))
        if pushes is None:
            await _answer(send, 400, b'{"error":"a JSON list of objects, each with a string key and an object params"}')
            return
        if self._relay is not None:
            outbox, engine = self._relay
            outbox.push_to_engine(engine, pushes)  # the POST's batch, one message
            await _answer(send, 204, b"")
            return
        self._arrived.put(pushes)
        for key, _ in pushes:
            if (event := self._waiting.get(key)) is not None:
                event.set()
        await _answer(send, 204, b"")

    async def _probe(self, scope: Scope, send: Send) -> None:
        """The router's probe: this worker takes part (and where its engine takes pushes); asked, whether this host reaches
        a peer's inbox."""
        answer: dict[str, Any] = {"handoff": 1, **({"inbox": self.inbox} if self.inbox else {})}
        asked = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(HANDOFF_REACH_QUERY)
        if asked is not None:
            peer = urlsplit(asked[0])
            try:
                port = peer.port
            except ValueError:
                port = None
            if peer.scheme != "tcp" or not peer.hostname or port is None:
                await _answer(send, 400, json.dumps({"error": f"{HANDOFF_REACH_QUERY}: a tcp://host:port, not {asked[0][:100]!r}"}).encode())
                return
            answer["reaches"] = await _reaches(peer.hostname, port)
        await _answer(send, 200, json.dumps(answer, separators=(",", ":")).encode())

    async def _generation(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A generation request that says it is an early leg: it waits for its push here; one that is not goes on as it came."""
        body = await _body(receive)
        early = _early_leg(body)
        if early is not None:
            request, key = early
            pushed = await self._pushed(key, receive)
            if pushed is _GONE:
                return  # the router closed the leg: nothing reached vLLM
            params = pushed[1] if isinstance(pushed, tuple) else None
            held = request["kv_transfer_params"]
            request["kv_transfer_params"] = {**held, **params} if params is not None else None
            if params is None:
                log.warning("early leg %s: no push came in %.0f s; the prompt is computed here", key, WAIT_LIMIT_S)
            elif self.writer is not None and isinstance(held.get(REQUEST_ID_PARAM), str):
                self.writer.event("handoff_in", rid=held[REQUEST_ID_PARAM])
            body = json.dumps(request).encode()
        await self.app(scope, _replay(body, receive), send)

    async def _pushed(self, key: str, receive: Receive | None) -> tuple[float, dict[str, Any]] | None | object:
        """``key``'s push: when it came (monotonic) and its parameters; None when none came in :data:`WAIT_LIMIT_S`;
        :data:`_GONE` when the client left first (``receive``: the connection to watch; None: the caller's cancellation)."""
        if key not in self._arrived:
            event = self._waiting[key] = asyncio.Event()
            waits = [asyncio.ensure_future(event.wait())]
            if receive is not None:
                waits.append(asyncio.ensure_future(_disconnected(receive)))
            try:
                await asyncio.wait(waits, timeout=WAIT_LIMIT_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits:
                    waiting.cancel()
                del self._waiting[key]
            if not event.is_set():
                left = waits[1:] and waits[1].done() and not waits[1].cancelled()
                return _GONE if left else None
        return self._arrived.take(key)


_GONE = object()

# vLLM's engine client method an early leg waits in, and its parameters as vLLM 0.26 and 0.32 have them.
_HOLD_METHOD, _HOLD_SIGNATURE = "_add_request", ("self", "request", "prompt", "parent_req", "index", "queue")
# ... and the one vLLM calls with a request's kv_transfer_params when it refused the request or the request's task was
# cancelled before it reached the engine (vLLM's _with_kv_transfer_rejection_cleanup), both versions alike.
_REJECTED_METHOD, _REJECTED_SIGNATURE = "notify_kv_transfer_request_rejected", ("self", "request_id", "kv_transfer_params", "data_parallel_rank")


def hold_in_engine_client(middleware: HandoffMiddleware, engine_client: type | None = None) -> bool:
    """Make ``engine_client``'s ``_add_request`` (vLLM's ``AsyncLLM``: where a parsed, rendered request goes to the engine core)
    hold early legs until ``middleware`` has their push; False where it has no such method (the server holds them then).

    Called in the server's process when vLLM builds its app, before any request; the last middleware built holds (one per
    server). A request is an early leg when its parameters name a hand-off key and a remote prefill not yet located
    (:func:`~hybrid_pd.connector.vllm.pushes.held_key`); any other goes on untouched.

    vLLM also hands a request's parameters to its engine core when it refused the request (a bad ``max_tokens``) or the
    request's task was cancelled (its client left) before it was added: a "rejected" request whose connector frees the
    prefill's blocks. A held leg's parameters do not yet say where those are, and vLLM 0.32's NIXL scheduler dies on them
    (``KeyError: 'remote_block_ids'``: the decode engine down, every request after it failing). So that notice waits for
    the push too and goes with the pushed parameters (the prefill's blocks freed, as when the leg waited in the server),
    or not at all when no push came. Without both methods as checked, the server holds early legs.
    """
    if engine_client is None:
        try:
            from vllm.v1.engine.async_llm import AsyncLLM as engine_client
        except ImportError:
            return False
    add, rejected = (_unwrapped(engine_client, name, signature) for name, signature in ((_HOLD_METHOD, _HOLD_SIGNATURE),
                                                                                      (_REJECTED_METHOD, _REJECTED_SIGNATURE)))  # fmt: skip
    if add is None or rejected is None:
        log.info("early legs wait in the server: %s lacks the engine client methods this vLLM was checked with (%s, %s)",
                 engine_client.__name__, _HOLD_METHOD, _REJECTED_METHOD)  # fmt: skip
        return False

    async def _add_request(self: Any, request: Any, prompt: Any, parent_req: Any, index: int, queue: Any) -> Any:
        extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
        params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
        if held_key(params) is not None:
            extra["kv_transfer_params"] = await middleware.release(params)
        return await add(self, request, prompt, parent_req, index, queue)

    async def notify_kv_transfer_request_rejected(self: Any, request_id: str, kv_transfer_params: Any, *, data_parallel_rank: Any = None) -> None:
        if held_key(kv_transfer_params) is not None:
            kv_transfer_params = await middleware.release(kv_transfer_params)
            if kv_transfer_params is None:
                return  # no push: no prefill's blocks this worker knows of
        await rejected(self, request_id, kv_transfer_params, data_parallel_rank=data_parallel_rank)

    for name, original, wrapper in ((_HOLD_METHOD, add, _add_request), (_REJECTED_METHOD, rejected, notify_kv_transfer_request_rejected)):
        wrapper.__wrapped_by_hybrid_pd__ = original  # type: ignore[attr-defined]
        setattr(engine_client, name, wrapper)
    return True


def _unwrapped(engine_client: type, name: str, signature: tuple[str, ...]) -> Callable[..., Awaitable[Any]] | None:
    """``engine_client``'s coroutine method ``name`` as vLLM defines it (under our wrapper, if a server app was built before),
    or None where it lacks it or its parameters are not ``signature``."""
    method = getattr(engine_client, name, None)
    original = getattr(method, "__wrapped_by_hybrid_pd__", method)
    if original is None or not inspect.iscoroutinefunction(original) or tuple(inspect.signature(original).parameters) != signature:
        return None
    return original


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _reaches(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` opens from here within :data:`REACH_TIMEOUT_S` (closed at once, nothing sent)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), REACH_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _disconnected(receive: Receive) -> None:
    """Returns when the client closes the connection (the only message left after the body)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _replay(body: bytes, receive: Receive) -> Receive:
    """The request's (possibly rewritten) body for the app, once; then the connection's own messages."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _early_leg(body: bytes) -> tuple[dict[str, Any], str] | None:
    """An early leg's request and key: parameters with a hand-off key and no prefill named yet; else None."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    key = held_key(request.get("kv_transfer_params")) if isinstance(request, dict) else None
    return (request, key) if key is not None else None


async def _answer(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json")] if body else []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
