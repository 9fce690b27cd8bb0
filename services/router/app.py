"""The public, OpenAI-compatible endpoint in front of prefill and decode workers.

A request reads top to bottom in :func:`_route`: choose the decode worker ->
choose a compatible prefill worker -> prefill leg -> decode leg; :func:`_serve`
then relays the answer with merged usage. Failures are handled where they happen:
a failed prefill leg falls back to a local prefill on the decode worker, a decode
worker that fails before its first byte is replaced once, a stream that breaks
ends with an OpenAI error event, and a client that goes away cancels the decode
request (vLLM aborts it and the prefill's held blocks are released).
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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from connector.compat import WorkerIdentity
from services.common.logs import kv, request_id_var
from services.common.openai_errors import OpenAIError, error_body, error_event
from services.router.admin import admin_routes
from services.router.disconnect import cancel_on_disconnect
from services.router.legs import decode_body, merge_usage, prefill_body
from services.router.metrics import RouterMetrics
from services.router.policies import Policy, RequestInfo, make_policy
from services.router.registry import Registry, Worker, probe_identity
from services.router.settings import RouterSettings
from services.router.upstream import AiohttpTransport, Upstream

__all__ = ["create_app", "RouterState"]

log = logging.getLogger("hybrid_pd.router")

_JSON = "application/json"


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


def create_app(settings: RouterSettings, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
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

    app = FastAPI(title="hybrid-pd router", lifespan=lifespan)
    app.state.router = state
    app.include_router(admin_routes(state))

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        state.metrics.rejected.labels(str(exc.status)).inc()
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(404, f"no route {request.method} {request.url.path}"), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(405, f"{request.method} not allowed on {request.url.path}"), status_code=405)

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
        _authorize(request, settings.api_keys)
        decodes = [w for w in registry.role("decode") if w.available]
        if not decodes:
            raise OpenAIError(503, "no decode worker is available")
        try:
            upstream = await state.upstream.get(decodes[0].url + "/v1/models")
        except httpx.HTTPError as exc:
            raise OpenAIError(502, f"decode worker unreachable: {type(exc).__name__}") from exc
        return Response(upstream.content, status_code=upstream.status_code, media_type=_JSON)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(state, request, "/v1/chat/completions")

    return app


async def _health_loop(state: RouterState) -> None:
    """Check every worker's health, learn identities of static workers, expire silent dynamic ones."""
    while True:
        await state.registry.check_all(state.upstream)
        for worker in state.registry.all():
            if worker.identity.model is None and worker.healthy:
                with suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                    worker.identity = await probe_identity(state.upstream, worker.url, worker.role)
        await asyncio.sleep(state.settings.health_interval_s)


def _authorize(request: Request, keys: list[str]) -> None:
    if not keys:
        return
    header = request.headers.get("authorization", "")
    if not header.startswith("Bearer ") or header[7:] not in keys:
        raise OpenAIError(401, "missing or invalid API key (Authorization: Bearer ...)")


async def _read_body(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"request body is larger than {limit} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise OpenAIError(413, f"request body is larger than {limit} bytes")
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


async def _serve(state: RouterState, request: Request, path: str) -> Response:
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    request_id_var.set(request_id)
    arrived = time.perf_counter()
    route = path.rsplit("/", 1)[-1]
    _authorize(request, state.settings.api_keys)
    body = await _read_body(request, state.settings.max_body_bytes)
    if state.inflight >= state.settings.max_concurrency:
        raise OpenAIError(429, f"the router is at its concurrency limit ({state.settings.max_concurrency})")
    state.inflight += 1
    done = _once(lambda: setattr(state, "inflight", state.inflight - 1))
    try:
        headers = {"X-Request-Id": request_id}
        stream = bool(body.get("stream"))
        # Until the answer starts, nothing else reads from the client: a client that leaves must
        # cancel the legs here (a stream being relayed is watched by StreamingResponse).
        async with cancel_on_disconnect(request.receive):
            if path == "/v1/completions" and _is_prompt_list(body):
                bodies = [{**body, "prompt": p} for p in body["prompt"]]
                routed = await _route_all(state, path, bodies, request_id)
            else:
                routed = [await _route(state, path, body, request_id)]
            failed = next((r for r in routed if r.response.status_code != 200), None)
            if failed is not None or not stream:
                response = await _answer(routed, failed, body, headers)
                state.metrics.requests.labels(route, "ok" if failed is None else f"http_{failed.response.status_code}").inc()
                state.metrics.e2e.observe(time.perf_counter() - arrived)
                return response
        relay = _relay(state, routed, body, arrived, route)
        done_after_stream = _with_finally(relay, done)
        done = _once(lambda: None)  # the stream now owns the release
        return StreamingResponse(done_after_stream, media_type="text/event-stream", headers=headers)
    finally:
        done()


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
                leg = await _prefill_leg(state, prefill, path, body, headers, info)
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
            response = await upstream.request("POST", decode.url + path, json=decode_body(body, kv_params), headers=headers, stream=True)
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
    state: RouterState, prefill: Worker, path: str, body: dict, headers: dict, info: RequestInfo
) -> dict | Routed | None:
    """The prefill answer (JSON); a Routed error for a 4xx; None when the leg failed (fall back)."""
    release = _lease(state, prefill, info.est_tokens)
    started = time.perf_counter()
    try:
        response = await state.upstream.request("POST", prefill.url + path, json=prefill_body(body), headers=headers)
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


async def _answer(routed: list[Routed], failed: Routed | None, body: dict, headers: dict) -> Response:
    """A whole (non-streamed) answer, or the first failed leg's error as it came."""
    try:
        if failed is not None:
            content = await failed.response.aread()
            return Response(content, status_code=failed.response.status_code, media_type=_JSON, headers=headers)
        answers = []
        for r in routed:
            answer = json.loads(await r.response.aread())
            answer["usage"] = merge_usage(r.prefill_usage, answer.get("usage"))
            answers.append(answer)
        return JSONResponse(_merge_answers(answers, body), headers=headers)
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


async def _relay(state: RouterState, routed: list[Routed], body: dict, arrived: float, route: str) -> AsyncIterator[bytes]:
    """Stream the decode answer(s) to the client with merged usage.

    Cancelling this generator (client gone) closes every upstream stream, which
    makes vLLM abort the request.
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
                yield chunk
        except _StreamBroke as broke:
            outcome = "stream_error"
            log.warning("decode stream broke %s", kv(worker=broke.worker, error=broke.error))
            yield error_event(502, f"decode worker failed mid-stream: {broke.error}")
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


async def _with_finally(stream: AsyncIterator[bytes], finish: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    finally:
        finish()

