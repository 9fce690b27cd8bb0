"""The public, OpenAI-compatible endpoint in front of prefill and decode workers.

A request reads top to bottom in :func:`_route`: choose the decode worker ->
choose a compatible prefill worker -> prefill leg -> decode leg; :func:`_serve`
then relays the answer with merged usage. Failures are handled where they happen:
a failed prefill leg falls back to a local prefill on the decode worker, a decode
worker that fails before its first byte is replaced once, a stream that breaks
ends with an OpenAI error event, and a client that goes away cancels the decode
request (vLLM aborts it and the prefill's held blocks are released).

The two generation paths (``POST /v1/completions``, ``POST /v1/chat/completions``) carry
all the traffic and are served as plain ASGI (:class:`RouterApp`): Starlette's middleware,
routing, FastAPI's dependency solving and its request and response objects cost more CPU per
request than anything the router does itself. Every other route is FastAPI's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Message, Receive, Scope, Send

from connector.compat import WorkerIdentity
from services.common.logs import kv, request_id_var
from services.common.openai_errors import OpenAIError, error_body, error_event
from services.router.admin import admin_routes
from services.router.disconnect import cancel_on_disconnect
from services.router.legs import LegEncoder, decode_body, merge_usage, prefill_body
from services.router.metrics import RouterMetrics
from services.router.policies import Policy, RequestInfo, make_policy
from services.router.registry import Registry, Worker, probe_identity
from services.router.settings import RouterSettings
from services.router.upstream import AiohttpTransport, Upstream

__all__ = ["create_app", "RouterApp", "RouterState"]

log = logging.getLogger("hybrid_pd.router")

_JSON = "application/json"

# The generation paths served as plain ASGI, and their ``route`` label in the metrics.
_GENERATION_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "completions"}
# What Starlette's JSONResponse writes: compact, UTF-8 as is, no NaN or Infinity.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_JSON_TYPE = (b"content-type", b"application/json")
_SSE_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")


@dataclass
class RouterState:
    """Everything a request needs, built once per app."""

    settings: RouterSettings
    registry: Registry
    metrics: RouterMetrics
    decode_policy: Policy
    prefill_policy: Policy
    upstream: Upstream | None = None
    inflight: int = 0


@dataclass
class Routed:
    """An open decode answer plus what the relay needs to finish the request."""

    response: httpx.Response
    prefill_usage: dict | None
    decode: Worker
    release: Callable[[], None]
    sent_at: float


class RouterApp(FastAPI):
    """The router's app: :func:`_serve` takes the generation paths as plain ASGI, FastAPI the rest."""

    def __init__(self, router_state: RouterState, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state.router = router_state
        self._router_state = router_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _GENERATION_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await super().__call__(scope, receive, send)
        elif scope["method"] != "POST":
            headers = [(b"allow", b"POST")]
            await _send_json(send, 405, _ENCODER.encode(_method_not_allowed(scope["method"], scope["path"])).encode(), headers)
        else:
            await _serve(self._router_state, scope, receive, send, route)


def create_app(settings: RouterSettings, transport: httpx.AsyncBaseTransport | None = None) -> RouterApp:
    """Build the router app for ``settings``; its HTTP client and health loop live as long as the app.

    Legs go over :class:`AiohttpTransport`; ``transport`` replaces it (tests of protocol edge cases only).
    """
    registry = Registry(settings.eviction_failures, settings.heartbeat_ttl_s)
    for role, urls in (("prefill", settings.prefill), ("decode", settings.decode)):
        for url in urls:
            registry.add(Worker(url=url, role=role, identity=WorkerIdentity(role=role), static=True))
    state = RouterState(
        settings=settings,
        registry=registry,
        metrics=RouterMetrics(),
        decode_policy=make_policy(settings.decode_policy),
        prefill_policy=make_policy(settings.prefill_policy),
    )
    timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A worker closes an idle connection after its keep-alive (uvicorn's 5 s in vLLM); reusing
        # one at that moment fails the leg with ReadError (seen under load: a decode retry and a
        # second prefill). Dropping idle connections first keeps reuse on the safe side.
        async with Upstream(transport or AiohttpTransport(keepalive_s=settings.upstream_keepalive_s), timeout) as upstream:
            state.upstream = upstream
            health = asyncio.create_task(_health_loop(state))
            try:
                yield
            finally:
                health.cancel()
                with suppress(asyncio.CancelledError):
                    await health

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
        ready = any(w.available for w in registry.role("decode"))
        body = {
            "status": "ok" if ready else "no decode worker available",
            "prefill": [w.url for w in registry.role("prefill")],
            "decode": [w.url for w in registry.role("decode")],
            "available": {role: [w.url for w in registry.role(role) if w.available] for role in ("prefill", "decode")},
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.evictions.set(registry.evictions)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _authorize(request.headers.get("authorization", ""), settings.api_keys)
        decodes = [w for w in registry.role("decode") if w.available]
        if not decodes:
            raise OpenAIError(503, "no decode worker is available")
        try:
            upstream = await state.upstream.get(decodes[0].url + "/v1/models")
        except httpx.HTTPError as exc:
            raise OpenAIError(502, f"decode worker unreachable: {type(exc).__name__}") from exc
        return Response(upstream.content, status_code=upstream.status_code, media_type=_JSON)

    return app


def _rejected(state: RouterState, exc: OpenAIError) -> dict[str, str] | None:
    """Count a request refused with ``exc``; the headers its answer carries (``Retry-After`` for 429 and 503)."""
    state.metrics.rejected.labels(str(exc.status)).inc()
    return {"Retry-After": "1"} if exc.status in (429, 503) else None


def _method_not_allowed(method: str, path: str) -> dict:
    return error_body(405, f"{method} not allowed on {path}")


async def _health_loop(state: RouterState) -> None:
    """Check every worker's health, learn identities of static workers, expire silent dynamic ones."""
    while True:
        await state.registry.check_all(state.upstream)
        for worker in state.registry.all():
            if worker.identity.model is None and worker.healthy:
                with suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                    worker.identity = await probe_identity(state.upstream, worker.url, worker.role)
        await asyncio.sleep(state.settings.health_interval_s)


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
        body = json.loads(raw, parse_constant=_not_a_json_number, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise OpenAIError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    return body


def _not_a_json_number(name: str) -> float:
    # Python's json reads NaN and Infinity; JSON has neither, and the legs could not send them on.
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of range for a JSON number")
    return value


def _is_prompt_list(body: dict[str, Any]) -> bool:
    """A completions request with several prompts: all strings or all token-id lists.

    Anything else (a mixed list, say) goes to vLLM as it came, so the client gets vLLM's own 400.
    """
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return False
    return all(isinstance(p, str) for p in prompt) or all(
        isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt
    )


async def _serve(state: RouterState, scope: Scope, receive: Receive, send: Send, route: str) -> None:
    """Answer one generation request, speaking ASGI: routed, then answered whole or relayed as a stream.

    An :class:`OpenAIError` becomes an OpenAI error answer (once an answer has started, there is
    nobody to tell: a client that left mid-stream); any other exception a 500 before it goes on
    to the server, as Starlette's error middleware does.
    """
    arrived = time.perf_counter()
    authorization, declared, request_id = "", None, None
    for name, value in scope["headers"]:  # names are lower case in ASGI; the first of repeated ones counts
        if name == b"authorization" and not authorization:
            authorization = value.decode("latin-1")
        elif name == b"content-length" and declared is None:
            declared = value.decode("latin-1")
        elif name == b"x-request-id" and request_id is None:
            request_id = value.decode("latin-1")
    request_id = request_id or uuid.uuid4().hex
    request_id_var.set(request_id)
    id_header = (b"x-request-id", request_id.encode("latin-1"))
    client = _Client(send)
    try:
        _authorize(authorization, state.settings.api_keys)
        body = await _read_body(receive, declared, state.settings.max_body_bytes)
        await _generate(state, client, receive, body, scope["path"], route, request_id, id_header, arrived)
    except OpenAIError as exc:
        if client.started:
            return
        headers = _rejected(state, exc) or {}
        extra = [id_header, *((k.lower().encode(), v.encode()) for k, v in headers.items())]
        await _send_json(send, exc.status, _ENCODER.encode(exc.body()).encode(), extra)
    except Exception:
        if not client.started:
            await _send_json(send, 500, _ENCODER.encode(error_body(500, "internal server error")).encode(), [id_header])
        raise


async def _generate(
    state: RouterState,
    client: _Client,
    receive: Receive,
    body: dict[str, Any],
    path: str,
    route: str,
    request_id: str,
    id_header: tuple[bytes, bytes],
    arrived: float,
) -> None:
    """Route ``body`` and answer the client: whole, or relayed as a stream."""
    if state.inflight >= state.settings.max_concurrency:
        raise OpenAIError(429, f"the router is at its concurrency limit ({state.settings.max_concurrency})")
    state.inflight += 1
    try:
        stream = bool(body.get("stream"))
        # Until the answer is complete, nothing else reads from the client: a client that leaves
        # must cancel the legs, or the stream being relayed, here.
        async with cancel_on_disconnect(receive):
            if path == "/v1/completions" and _is_prompt_list(body):
                bodies = [{**body, "prompt": p} for p in body["prompt"]]
                routed = await _route_all(state, path, bodies, request_id)
            else:
                routed = [await _route(state, path, body, request_id)]
            failed = next((r for r in routed if r.response.status_code != 200), None)
            whole: tuple[int, bytes] | None = None
            if failed is not None or not stream:
                whole = await _answer(routed, failed, body)
            else:
                await client.send({"type": "http.response.start", "status": 200, "headers": [_SSE_TYPE, id_header]})
                await _relay(state, routed, body, arrived, route, client.send)
        # The message that completes the answer goes out after the block: from then on a server's
        # receive says http.disconnect, which the block would take for the client leaving.
        if whole is None:
            await client.send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        status, content = whole
        await _send_json(client.send, status, content, [id_header])
        state.metrics.requests.labels(route, "ok" if failed is None else f"http_{status}").inc()
        state.metrics.e2e.observe(time.perf_counter() - arrived)
    finally:
        state.inflight -= 1


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


async def _route_all(state: RouterState, path: str, bodies: list[dict], request_id: str) -> list[Routed]:
    """One P/D pair per prompt (a shared ``remote_block_ids`` breaks vLLM), in order."""
    tasks = [asyncio.ensure_future(_route(state, path, b, f"{request_id}-{i}")) for i, b in enumerate(bodies)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                await _close(task.result())
        raise


async def _route(state: RouterState, path: str, body: dict[str, Any], request_id: str) -> Routed:
    """Choose the pair, run the prefill leg and open the decode leg (retried once before its first byte)."""
    started = time.perf_counter()
    settings, metrics, upstream = state.settings, state.metrics, state.upstream
    info = RequestInfo.from_body(body, settings.prefix_affinity_chars)
    encoder = LegEncoder(body)
    headers = {"X-Request-Id": request_id}
    tried: set[str] = set()
    prefill_s = 0.0
    for attempt in range(2):
        if not any(w.available for w in state.registry.role("decode")):
            await state.registry.check_all(upstream)  # evicted workers may be back: look now, not at the next round
        decode = _choose(state, state.registry.role("decode"), state.decode_policy, info, tried, "decode")
        kv_params, prefill_usage = None, None
        if info.est_tokens < settings.local_prefill_below_tokens:
            metrics.fallbacks.labels("short_prompt").inc()
        else:
            prefill = _pick_prefill(state, decode, info)
            if prefill is None:
                log.info("no compatible prefill worker available, local prefill %s", kv(decode=decode.url))
                metrics.fallbacks.labels("no_prefill_worker").inc()
            else:
                leg_started = time.perf_counter()
                leg = await _prefill_leg(state, prefill, path, encoder.encode(prefill_body(body)), headers, info)
                prefill_s += time.perf_counter() - leg_started
                if isinstance(leg, Routed):
                    return leg  # the prefill worker refused the request (4xx): the client gets that
                if leg is None:
                    metrics.fallbacks.labels("prefill_failed").inc()
                else:
                    kv_params, prefill_usage = leg.get("kv_transfer_params"), leg.get("usage")
        release = _lease(state, decode, info.est_tokens)
        sent_at = time.perf_counter()
        metrics.overhead.observe(max(0.0, sent_at - started - prefill_s))
        try:
            leg_body = encoder.encode(decode_body(body, kv_params))
            response = await upstream.request("POST", decode.url + path, json_body=leg_body, headers=headers, stream=True)
        except httpx.HTTPError as exc:
            release()
            log.warning("decode leg failed %s", kv(worker=decode.url, error=type(exc).__name__, attempt=attempt))
        except BaseException:
            release()  # cancelled (the client left): the leg is not in flight any more
            raise
        else:
            if response.status_code < 500:
                if log.isEnabledFor(logging.INFO):  # one line per request: skip formatting it when INFO is off
                    log.info("routed %s", kv(path=path, decode=decode.url, status=response.status_code, transfer=kv_params is not None))
                return Routed(response, prefill_usage, decode, release, sent_at)
            release()
            await response.aclose()
            log.warning("decode leg failed %s", kv(worker=decode.url, status=response.status_code, attempt=attempt))
        state.registry.record_health(decode, ok=False)
        tried.add(decode.id)
        if attempt == 0 and any(w.available and w.id not in tried for w in state.registry.role("decode")):
            metrics.retries.inc()
            continue
        break
    raise OpenAIError(502, "decode worker failed before answering")


def _choose(state: RouterState, workers: Sequence[Worker], policy: Policy, info: RequestInfo, tried: set[str], role: str) -> Worker:
    """Filter (available, not tried, under its limit), then let the policy pick."""
    available = [w for w in workers if w.available and w.id not in tried]
    if not available:
        raise OpenAIError(503, f"no {role} worker is available")
    under_limit = [w for w in available if w.inflight < state.settings.max_concurrency_per_worker]
    if not under_limit:
        raise OpenAIError(429, f"every {role} worker is at its concurrency limit")
    return policy.choose(under_limit, info)


def _pick_prefill(state: RouterState, decode: Worker, info: RequestInfo) -> Worker | None:
    candidates = [w for w in state.registry.compatible_with(decode) if w.inflight < state.settings.max_concurrency_per_worker]
    return state.prefill_policy.choose(candidates, info) if candidates else None


async def _prefill_leg(
    state: RouterState, prefill: Worker, path: str, leg_body: bytes, headers: dict, info: RequestInfo
) -> dict | Routed | None:
    """The prefill answer (JSON) to ``leg_body``; a Routed error for a 4xx; None when the leg failed (fall back)."""
    release = _lease(state, prefill, info.est_tokens)
    started = time.perf_counter()
    try:
        response = await state.upstream.request("POST", prefill.url + path, json_body=leg_body, headers=headers)
    except httpx.HTTPError as exc:
        log.warning("prefill leg failed, local prefill %s", kv(worker=prefill.url, error=type(exc).__name__))
        state.registry.record_health(prefill, ok=False)
        return None
    finally:
        release()
        state.metrics.prefill_leg.observe(time.perf_counter() - started)
    if 400 <= response.status_code < 500:
        log.info("prefill refused %s", kv(worker=prefill.url, status=response.status_code))
        return Routed(response, None, prefill, lambda: None, time.perf_counter())
    if response.status_code != 200:
        log.warning("prefill leg failed, local prefill %s", kv(worker=prefill.url, status=response.status_code))
        return None
    return response.json()


def _lease(state: RouterState, worker: Worker, tokens: int) -> Callable[[], None]:
    """Count a leg as in flight on ``worker`` until the returned function is called (once)."""
    worker.inflight += 1
    worker.inflight_tokens += tokens
    gauge = state.metrics.inflight.labels(worker.role, worker.url)
    gauge.set(worker.inflight)

    def release() -> None:
        worker.inflight -= 1
        worker.inflight_tokens -= tokens
        gauge.set(worker.inflight)

    return _once(release)


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    called = False

    def wrapper() -> None:
        nonlocal called
        if not called:
            called = True
            fn()

    return wrapper


async def _close(routed: Routed) -> None:
    routed.release()
    await routed.response.aclose()


async def _answer(routed: list[Routed], failed: Routed | None, body: dict) -> tuple[int, bytes]:
    """A whole (non-streamed) answer, or the first failed leg's error as it came: (status, JSON)."""
    try:
        if failed is not None:
            return failed.response.status_code, await failed.response.aread()
        answers = []
        for r in routed:
            answer = json.loads(await r.response.aread())
            answer["usage"] = merge_usage(r.prefill_usage, answer.get("usage"))
            answers.append(answer)
        return 200, _ENCODER.encode(_merge_answers(answers, body)).encode()
    finally:
        for r in routed:
            await _close(r)


def _merge_answers(answers: list[dict], body: dict) -> dict:
    """One answer from one-per-prompt answers: choices renumbered in prompt order, usage summed."""
    if len(answers) == 1:
        return answers[0]
    n = int(body.get("n") or 1)
    merged = dict(answers[0])
    merged["choices"] = [
        {**choice, "index": i * n + choice.get("index", 0)} for i, a in enumerate(answers) for choice in a["choices"]
    ]
    merged["usage"] = _sum_usage([a.get("usage") for a in answers])
    return merged


def _sum_usage(usages: list[dict | None]) -> dict | None:
    present = [u for u in usages if u]
    if not present:
        return None
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {**present[0], **{k: sum(u.get(k) or 0 for u in present) for k in keys}}


class _StreamBroke(Exception):
    """A decode stream failed mid-way; the client gets an error event instead of the rest."""

    def __init__(self, worker: str, error: BaseException) -> None:
        super().__init__(f"{worker}: {type(error).__name__}")
        self.worker, self.error = worker, type(error).__name__


async def _relay(state: RouterState, routed: list[Routed], body: dict, arrived: float, route: str, send: Send) -> None:
    """Stream the decode answer(s) to the client with merged usage, as ``http.response.body`` messages.

    The answer's start has been sent, its end is the caller's. Cancelling this (client gone)
    closes every upstream stream, which makes vLLM abort the request.
    """
    metrics = state.metrics
    chunks = _relay_one(routed[0]) if len(routed) == 1 else _relay_several(routed, body)
    first, last = True, time.perf_counter()
    outcome = "ok"
    try:
        try:
            async for chunk in chunks:
                now = time.perf_counter()
                if first:
                    metrics.ttft.observe(now - arrived)
                    first = False
                else:
                    metrics.itl.observe(now - last)
                last = now
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except _StreamBroke as broke:
            outcome = "stream_error"
            log.warning("decode stream broke %s", kv(worker=broke.worker, error=broke.error))
            await send({"type": "http.response.body", "body": error_event(502, f"decode worker failed mid-stream: {broke.error}"), "more_body": True})
    except asyncio.CancelledError:
        outcome = "client_disconnected"
        log.info("client disconnected; aborting decode %s", kv(workers=[r.decode.url for r in routed]))
        raise
    finally:
        await chunks.aclose()
        for r in routed:
            await _close(r)
        metrics.requests.labels(route, outcome).inc()
        metrics.e2e.observe(time.perf_counter() - arrived)
        metrics.decode_leg.observe(time.perf_counter() - routed[0].sent_at)


async def _relay_one(r: Routed) -> AsyncIterator[bytes]:
    """One decode stream's bytes as they arrive, cut after the last complete event of each read.

    Only an event that carries a usage object is parsed (to merge the prefill's usage into it);
    vLLM sends one, the last before its own ``[DONE]``, which goes to the client as it came.
    """
    pending = b""
    try:
        async for data in r.response.aiter_bytes():
            pending += data
            end = pending.rfind(b"\n\n")
            if end < 0:
                continue  # no complete event yet
            events, pending = pending[: end + 2], pending[end + 2 :]
            # vLLM writes compact JSON: a token event has no usage or "usage":null.
            if r.prefill_usage is not None and b'"usage":{' in events:
                events = _merge_usage_events(events, r.prefill_usage)
            yield events
    except httpx.HTTPError as exc:
        raise _StreamBroke(r.decode.url, exc) from exc
    if pending:
        yield pending


def _merge_usage_events(events: bytes, prefill_usage: dict) -> bytes:
    """``events`` (complete SSE events) with the prefill's usage merged into each usage object."""
    out = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            parsed = json.loads(event[6:])
            parsed["usage"] = merge_usage(prefill_usage, parsed["usage"])
            event = b"data: " + json.dumps(parsed, separators=(",", ":")).encode()
        out.append(event)
    return b"\n\n".join(out)


async def _relay_several(routed: list[Routed], body: dict) -> AsyncIterator[bytes]:
    """Decode streams of one prompt each, merged event by event into one answer.

    Choice indexes are renumbered in prompt order and the usages summed into one final
    usage event, so every event is parsed here.
    """
    n = int(body.get("n") or 1)
    usages: list[dict | None] = [None] * len(routed)
    queue: asyncio.Queue[tuple[int, str | None | BaseException]] = asyncio.Queue()

    async def pump(i: int, r: Routed) -> None:
        try:
            async for line in r.response.aiter_lines():
                await queue.put((i, line))
        except BaseException as exc:  # noqa: BLE001 - delivered to the consumer below
            await queue.put((i, exc))
        else:
            await queue.put((i, None))

    pumps = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(routed)]
    open_streams = len(routed)
    try:
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, BaseException):
                raise _StreamBroke(routed[i].decode.url, item) from item
            if not item or item.startswith("data: [DONE]"):
                continue  # events are re-delimited below; one [DONE] ends the merged answer
            if not item.startswith("data: {"):
                yield (item + "\n\n").encode()
                continue
            event = json.loads(item[6:])
            if event.get("usage") is not None:
                usages[i] = merge_usage(routed[i].prefill_usage, event["usage"])
                if not event.get("choices"):
                    continue  # the merged usage chunk goes out once, at the end
            event["choices"] = [{**c, "index": i * n + c.get("index", 0)} for c in event.get("choices", [])]
            event.pop("usage", None)
            yield ("data: " + json.dumps(event, separators=(",", ":")) + "\n\n").encode()
        if any(usages) and (body.get("stream_options") or {}).get("include_usage"):
            tail = {"id": routed[0].response.headers.get("x-request-id", ""), "object": "text_completion", "choices": []}
            tail["usage"] = _sum_usage(usages)
            yield ("data: " + json.dumps(tail, separators=(",", ":")) + "\n\n").encode()
        yield b"data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
