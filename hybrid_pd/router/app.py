"""The public, OpenAI-compatible endpoint in front of prefill and decode workers.

This module is the HTTP surface: dispatch, the request body, auth, refusals, ``/health`` and
``/metrics``. A generation request is routed by
:func:`hybrid_pd.router.route.route_request` (pairing, prefill leg, decode leg) and answered
by :mod:`hybrid_pd.router.relay` (answers merged, streams relayed with merged usage). A
client that goes away cancels the request where it stands (:mod:`hybrid_pd.router.disconnect`):
vLLM aborts it and the prefill's held blocks are released.

The two generation paths (``POST /v1/completions``, ``POST /v1/chat/completions``) carry
all the traffic and are served as plain ASGI (:class:`RouterApp`): Starlette's middleware,
routing, FastAPI's dependency solving and its request and response objects cost more CPU per
request than anything the router does itself. vLLM's model-level paths that the router
forwards to a decode worker (:mod:`hybrid_pd.router.aux_endpoints`: ``/tokenize``,
``/v1/models``, ...) go the same way, so they share the generation paths' auth, body limit
and error answers. Every other route is FastAPI's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Message, Receive, Scope, Send

from hybrid_pd.common.logs import request_id_var
from hybrid_pd.common.openai_errors import OpenAIError, error_body
from hybrid_pd.connector.compat import WorkerIdentity
from hybrid_pd.router import inbox_reach
from hybrid_pd.router.admin import admin_routes
from hybrid_pd.router.autoscale import register_signals
from hybrid_pd.router.aux_endpoints import AUX_PATHS, forward
from hybrid_pd.router.disconnect import cancel_on_disconnect
from hybrid_pd.router.health import health_body
from hybrid_pd.router.jsoncodec import dumps, loads_strict
from hybrid_pd.router.metrics import GENERATION, Route, RouterMetrics
from hybrid_pd.router.pairing import Pairing
from hybrid_pd.router.planner import PEER_PATH, Planner
from hybrid_pd.router.policies import PolicyContext, RequestInfo, make_policy
from hybrid_pd.router.prompt_count import count_prompt
from hybrid_pd.router.registry import Registry, Worker
from hybrid_pd.router.relay import answer_whole, relay_answers
from hybrid_pd.router.request_slo import TPOT_HEADER, TTFT_HEADER, request_slo, router_slo
from hybrid_pd.router.route import decode_chunks, route_request
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.router.state import RouterState
from hybrid_pd.sizing.traffic import TrafficWindow
from hybrid_pd.router.upstream import AiohttpTransport, Upstream
from hybrid_pd.sizing.profile import Profile, profile_path
from hybrid_pd.sizing.workload import SLO

__all__ = ["create_app", "RouterApp"]


# The paths served as plain ASGI: path -> (its method, its ``route`` label in the metrics).
_ASGI_PATHS: dict[str, tuple[str, Route]] = {
    "/v1/completions": ("POST", "completions"),
    "/v1/chat/completions": ("POST", "chat"),
    **AUX_PATHS,
}
_JSON_TYPE = (b"content-type", b"application/json")
_SSE_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")


class RouterApp(FastAPI):
    """The router's app: :func:`_serve` takes the generation and forwarded paths as plain ASGI, FastAPI the rest."""

    def __init__(self, router_state: RouterState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state.router = router_state
        self._router_state = router_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        served = _ASGI_PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if served is None:
            await super().__call__(scope, receive, send)
        elif scope["method"] != served[0]:
            headers = [(b"allow", served[0].encode())]
            await _send_json(send, 405, dumps(_method_not_allowed(scope["method"], scope["path"])), headers)
        else:
            await _serve(self._router_state, scope, receive, send, served[1])


def _policy_context(settings: RouterSettings, metrics: RouterMetrics, role: str) -> PolicyContext:
    return PolicyContext(settings.prefix_index_tokens, settings.prefix_load_slack, metrics.prefix_reporter(role))


def create_app(settings: RouterSettings, transport: httpx.AsyncBaseTransport | None = None) -> RouterApp:
    """Build the router app for ``settings``; its HTTP client and health loop live as long as the app.

    Legs go over :class:`AiohttpTransport`; ``transport`` replaces it (tests of protocol edge cases only).
    """
    metrics = RouterMetrics()
    registry = Registry(settings.eviction_failures, settings.heartbeat_ttl_s, inflight_gauge=metrics.inflight)
    for role, urls in (("prefill", settings.prefill), ("decode", settings.decode), ("flex", settings.flex)):
        for url in urls:
            registry.add(Worker(url=url, role=role, identity=WorkerIdentity(role=role), static=True))
    traffic = TrafficWindow(settings.planner_window_s, settings.planner_interval_s)
    pairing = Pairing(
        registry,
        decode_policy=make_policy(settings.decode_policy, _policy_context(settings, metrics, "decode")),
        prefill_policy=make_policy(settings.prefill_policy, _policy_context(settings, metrics, "prefill")),
        min_tokens=settings.local_prefill_below_tokens,
        per_worker_limit=settings.max_concurrency_per_worker,
        prompt_tokens=traffic.prompt_tokens,
    )
    register_signals(metrics.registry, registry, settings.max_concurrency_per_worker)
    profile = Profile.load(profile_path(settings.planner_profile)) if settings.planner_profile is not None else None
    planner = Planner(settings, registry, pairing, metrics, traffic, profile)
    state = RouterState(settings=settings, registry=registry, metrics=metrics, pairing=pairing, planner=planner)
    timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A worker closes an idle connection after its keep-alive (uvicorn's 5 s in vLLM); reusing
        # one at that moment fails the leg with ReadError (seen under load: a decode retry and a
        # second prefill). Dropping idle connections first keeps reuse on the safe side.
        async with Upstream(transport or AiohttpTransport(keepalive_s=settings.upstream_keepalive_s), timeout) as upstream:
            state.upstream = upstream
            health = asyncio.create_task(registry.watch(upstream, settings.health_interval_s))
            reach = asyncio.create_task(inbox_reach.watch(registry, upstream, settings.health_interval_s))
            plans = asyncio.create_task(planner.run(upstream)) if planner.looks else None
            try:
                yield
            finally:
                for task in (health, reach, plans):
                    if task is not None:
                        task.cancel()
                        with suppress(asyncio.CancelledError):
                            await task

    app = RouterApp(state, title="hybrid-pd router", lifespan=lifespan)
    app.include_router(admin_routes(state))

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=_rejected(state, exc))

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(404, f"no route {request.method} {request.url.path}"), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(_method_not_allowed(request.method, request.url.path), status_code=405)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when a decode worker can take requests (prefill workers are optional: local prefill), else 503."""
        ready = pairing.decode_available()
        return JSONResponse(health_body(registry, ready), status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.evictions.set(registry.evictions)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/planner")
    async def planner_state() -> JSONResponse:
        """The flexible workers' roles by URL, the layout, the leading router and the last decision."""
        return JSONResponse(planner.snapshot())

    @app.get(PEER_PATH)
    async def planner_peer() -> JSONResponse:
        """What this router shares with its peers (``--planner-peer``): its id, whether it decides, its roles and traffic."""
        return JSONResponse(planner.peer())

    return app


def _rejected(state: RouterState, exc: OpenAIError) -> dict[str, str] | None:
    """Count a request the router answers with ``exc``; the headers its answer carries (``Retry-After`` for 429 and 503)."""
    state.metrics.rejected.labels(str(exc.status)).inc()
    return {"Retry-After": "1"} if exc.status in (429, 503) else None


def _method_not_allowed(method: str, path: str) -> dict:
    return error_body(405, f"{method} not allowed on {path}")


def _authorize(header: str, keys: list[str]) -> None:
    """Refuse (401) unless ``header``, the request's ``Authorization``, names one of ``keys`` (none: open)."""
    if not keys:
        return
    if not header.startswith("Bearer ") or header[7:] not in keys:
        raise OpenAIError(401, "missing or invalid API key (Authorization: Bearer ...)")


async def _read_body(receive: Receive, declared: str | None, limit: int) -> dict[str, Any]:
    """The request's JSON object, read from ``receive``; 413 past ``limit`` bytes (``declared``: its Content-Length)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"request body is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise OpenAIError(499, "client disconnected while sending its request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise OpenAIError(413, f"request body is larger than {limit} bytes")
        chunks.append(chunk)
        more = message.get("more_body", False)
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        body = loads_strict(raw)
    except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError among them
        raise OpenAIError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    return body


async def _serve(state: RouterState, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
    """Answer one request on a plain-ASGI path, speaking ASGI: a generation request routed, then
    answered whole or relayed as a stream; any other forwarded to a decode worker.

    An :class:`OpenAIError` becomes an OpenAI error answer (once an answer has started, there is
    nobody to tell: a client that left mid-stream); any other exception a 500 before it goes on
    to the server, as Starlette's error middleware does. A client that left before its answer
    (499) counts as a request of its route that ended ``client_disconnected``, not as a refusal.
    """
    arrived = time.perf_counter()
    authorization, declared, request_id = "", None, None
    targets: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:  # names are lower case in ASGI; the first of repeated ones counts
        if name == b"authorization" and not authorization:
            authorization = value.decode("latin-1")
        elif name == b"content-length" and declared is None:
            declared = value.decode("latin-1")
        elif name == b"x-request-id" and request_id is None:
            request_id = value.decode("latin-1")
        elif name in (TTFT_HEADER, TPOT_HEADER):
            targets.setdefault(name, value)
    request_id = request_id or uuid.uuid4().hex
    request_id_var.set(request_id)
    id_header = (b"x-request-id", request_id.encode("latin-1"))
    client = _Client(send)
    try:
        _authorize(authorization, state.settings.api_keys)
        body = await _read_body(receive, declared, state.settings.max_body_bytes) if scope["method"] == "POST" else None
        if route in GENERATION:
            assert body is not None  # generation paths are POST
            slo = request_slo(targets.get(TTFT_HEADER), targets.get(TPOT_HEADER), router_slo(state.settings))
            await _generate(state, client, receive, body, scope["path"], route, request_id, id_header, arrived, slo)
        else:
            status, content = await forward(state, scope["path"], body, request_id)
            await _send_json(client.send, status, content, [id_header])
            state.metrics.finished(route, "ok" if status == 200 else f"http_{status}", arrived)
    except OpenAIError as exc:
        if client.started:
            return
        if exc.status == 499:
            state.metrics.finished(route, "client_disconnected", arrived)
            headers = {}
        else:
            headers = _rejected(state, exc) or {}
        extra = [id_header, *((k.lower().encode(), v.encode()) for k, v in headers.items())]
        await _send_json(send, exc.status, dumps(exc.body()), extra)
    except Exception:
        if not client.started:
            await _send_json(send, 500, dumps(error_body(500, "internal server error")), [id_header])
        raise


async def _generate(
    state: RouterState,
    client: _Client,
    receive: Receive,
    body: dict[str, Any],
    path: str,
    route: Route,
    request_id: str,
    id_header: tuple[bytes, bytes],
    arrived: float,
    slo: SLO,
) -> None:
    """Route ``body`` and answer the client: whole, or relayed as a stream. ``slo``: the targets it asked for, which the
    planner sizes for."""
    if state.inflight >= state.settings.max_concurrency:
        raise OpenAIError(429, f"the router is at its concurrency limit ({state.settings.max_concurrency})")
    state.inflight += 1
    # What the planner measures (hybrid_pd/sizing/traffic.py): the estimates now, the workers' counts when the answer is done.
    traffic, info, asked = state.planner.traffic, RequestInfo.from_body(body), _max_tokens(body)
    estimate, exact = info.est_tokens, info.exact
    traffic.started(arrived, estimate, asked, slo, exact)
    if state.planner.looks:
        count_prompt(state, body, estimate, request_id, arrived)
    usage: dict[str, Any] = {}
    try:
        # Until the answer is complete, nothing else reads from the client: a client that leaves
        # must cancel the legs, or the stream being relayed, here.
        async with cancel_on_disconnect(receive):
            routed = await route_request(state, path, body, request_id)
            failed = next((r for r in routed if r.response.status_code != 200), None)
            whole: tuple[int, bytes] | None = None
            if failed is not None or not body.get("stream"):
                whole = await answer_whole(state.metrics, routed, failed, usage.update)
            else:
                await client.send({"type": "http.response.start", "status": 200, "headers": [_SSE_TYPE, id_header]})
                chunks_of = lambda answer: decode_chunks(state, path, answer, request_id)  # noqa: E731
                await relay_answers(state.metrics, routed, chunks_of, body, arrived, route, client.send, usage.update)
        # The message that completes the answer goes out after the block: from then on a server's
        # receive says http.disconnect, which the block would take for the client leaving.
        if whole is None:
            await client.send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        status, content = whole
        await _send_json(client.send, status, content, [id_header])
        state.metrics.finished(route, "ok" if failed is None else f"http_{status}", arrived)
    finally:
        state.inflight -= 1
        traffic.ended(time.perf_counter(), estimate, asked, usage.get("prompt_tokens"), usage.get("completion_tokens"), exact)


def _max_tokens(body: dict[str, Any]) -> int:
    """The most tokens the request may generate, as the client asked (vLLM's default of 16 for completions when it did not)."""
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    return asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else 16


class _Client:
    """The client's side of an ASGI request: ``send``, and whether the answer has started."""

    __slots__ = ("_send", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def send(self, message: Message) -> None:
        self.started = True
        await self._send(message)


async def _send_json(send: Send, status: int, content: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """A whole JSON answer (``content``, encoded), with ``headers`` besides its type and length."""
    start = [_JSON_TYPE, (b"content-length", str(len(content)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": content, "more_body": False})
