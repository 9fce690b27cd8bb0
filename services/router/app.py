"""The public, OpenAI-compatible endpoint in front of prefill and decode workers.

A request reads top to bottom in :func:`_disaggregate`: parse -> choose the pair ->
prefill leg -> decode leg -> relay the answer with merged usage.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.common.logs import kv, request_id_var
from services.common.openai_errors import OpenAIError, error_event
from services.router.legs import decode_body, merge_usage, prefill_body
from services.router.pool import Pair, StaticPool
from services.router.settings import RouterSettings

__all__ = ["create_app"]

log = logging.getLogger("hybrid_pd.router")

_JSON = "application/json"


def create_app(settings: RouterSettings, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """Build the router app for ``settings``; its HTTP client lives as long as the app.

    ``transport`` replaces the network (tests of protocol edge cases only).
    """
    pool = StaticPool(settings.prefill, settings.decode)
    timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
            app.state.client = client
            yield

    app = FastAPI(title="hybrid-pd router", lifespan=lifespan)
    app.state.pool = pool

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "prefill": pool.prefill, "decode": pool.decode}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        url = pool.pick().decode + "/v1/models"
        try:
            upstream = await request.app.state.client.get(url)
        except httpx.HTTPError as exc:
            raise OpenAIError(502, f"decode worker unreachable: {type(exc).__name__}") from exc
        return Response(upstream.content, status_code=upstream.status_code, media_type=_JSON)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _disaggregate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _disaggregate(request, "/v1/chat/completions")

    return app


async def _read_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    return body


async def _disaggregate(request: Request, path: str) -> Response:
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    request_id_var.set(request_id)
    started = time.perf_counter()
    body = await _read_body(request)
    pair: Pair = request.app.state.pool.pick()
    client: httpx.AsyncClient = request.app.state.client
    headers = {"X-Request-Id": request_id}

    # Prefill leg: state for token N-1 stays on the prefill worker for the decode to pull.
    try:
        prefill = await client.post(pair.prefill + path, json=prefill_body(body), headers=headers)
    except httpx.HTTPError as exc:
        log.warning("prefill leg failed %s", kv(worker=pair.prefill, error=type(exc).__name__))
        raise OpenAIError(502, f"prefill worker failed: {type(exc).__name__}") from exc
    if prefill.status_code != 200:
        log.info("prefill leg refused %s", kv(worker=pair.prefill, status=prefill.status_code))
        return Response(prefill.content, status_code=prefill.status_code, media_type=_JSON)
    prefill_json = prefill.json()
    prefill_usage = prefill_json.get("usage")
    prefill_ms = (time.perf_counter() - started) * 1000

    # Decode leg: the client's request plus where to pull the state from.
    outgoing = client.build_request(
        "POST", pair.decode + path, json=decode_body(body, prefill_json.get("kv_transfer_params")), headers=headers
    )
    try:
        decode = await client.send(outgoing, stream=True)
    except httpx.HTTPError as exc:
        log.warning("decode leg failed %s", kv(worker=pair.decode, error=type(exc).__name__))
        raise OpenAIError(502, f"decode worker failed: {type(exc).__name__}") from exc
    log.info(
        "routed %s",
        kv(path=path, prefill=pair.prefill, decode=pair.decode, prefill_ms=f"{prefill_ms:.1f}", status=decode.status_code),
    )
    response_headers = {"X-Request-Id": request_id}
    if decode.status_code != 200 or not body.get("stream"):
        content = await decode.aread()
        await decode.aclose()
        if decode.status_code == 200:
            answer = json.loads(content)
            answer["usage"] = merge_usage(prefill_usage, answer.get("usage"))
            return JSONResponse(answer, headers=response_headers)
        return Response(content, status_code=decode.status_code, media_type=_JSON, headers=response_headers)
    return StreamingResponse(
        _relay_stream(decode, prefill_usage, request_id),
        media_type="text/event-stream",
        headers=response_headers,
    )


async def _relay_stream(decode: httpx.Response, prefill_usage: dict | None, request_id: str) -> AsyncIterator[bytes]:
    """Relay the decode worker's SSE stream, rewriting usage; closing it aborts the decode.

    When the client goes away, the server cancels this generator and ``aclose``
    drops the upstream connection, which makes vLLM abort the request.
    """
    request_id_var.set(request_id)
    try:
        async for line in decode.aiter_lines():
            if line.startswith("data: {") and '"usage":' in line and '"usage":null' not in line:
                event = json.loads(line[6:])
                if event.get("usage") is not None:
                    event["usage"] = merge_usage(prefill_usage, event["usage"])
                    line = "data: " + json.dumps(event, separators=(",", ":"))
            yield (line + "\n").encode()
    except httpx.HTTPError as exc:
        log.warning("decode stream broke %s", kv(error=type(exc).__name__))
        yield error_event(502, f"decode worker failed mid-stream: {type(exc).__name__}")
    finally:
        await decode.aclose()
