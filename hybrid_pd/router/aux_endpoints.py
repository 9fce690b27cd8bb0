"""vLLM's model-level endpoints besides generation, answered by a decode worker serving the model.

Clients built for a vLLM server call more than the two generation paths: lm-eval's
``local-completions`` reads ``/tokenizer_info`` and tokenizes with ``/tokenize`` and
``/detokenize`` by default, benchmark clients and UIs ask ``/version`` and ``/v1/models``.
None of these needs P/D: any decode worker that serves the model answers them as vLLM does,
so the router forwards them and passes the answer on as it came (vLLM's own errors included).

The worker: an available decode worker whose model is the body's ``model`` (one whose model
is not known yet may be asked: vLLM answers for itself), or, with no ``model``, of the one
model the router serves; the least busy of them. No such worker is vLLM's own 404 (a model
named that no worker serves) or a 400 (no model named while the router serves several);
none available, a 503. ``/v1/models`` asks one worker per model and lists them all.

Not forwarded: paths that act on or describe one server, not the deployment (``/load``,
``/reset_prefix_cache``, ``/sleep``, ``/wake_up``, ``/collective_rpc``, ``/start_profile``,
``/server_info``, ``/v1/load_lora_adapter``, ``/kv_event_sources``, ``/ping``); generation the
router does not disaggregate (``/v1/responses``, ``/v1/messages``, ``/v1/chat/completions/batch``,
``/inference/v1/generate``, ``/invocations``): a decode worker would run it alone; pooling paths
(``/v1/embeddings``, ``/score``, ...), which a generation model does not serve.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.router.jsoncodec import dumps, loads_strict
from hybrid_pd.router.metrics import Route
from hybrid_pd.router.registry import DECODERS, Worker
from hybrid_pd.router.state import RouterState

__all__ = ["AUX_PATHS", "choose_worker", "forward"]

# path -> (its method, its ``route`` label in the metrics)
AUX_PATHS: dict[str, tuple[str, Route]] = {
    "/v1/models": ("GET", "models"),
    "/version": ("GET", "version"),
    "/tokenizer_info": ("GET", "tokenizer_info"),
    "/tokenize": ("POST", "tokenize"),
    "/detokenize": ("POST", "detokenize"),
}


async def _available(state: RouterState) -> list[Worker]:
    """The available workers that decode (flexible ones too); when there are none, evicted ones may be back: look now, as a
    generation request does."""
    if not state.pairing.decode_available():
        await state.registry.check_all(state.upstream)
    available = [w for w in state.registry.role(*DECODERS) if w.available]
    if not available:
        raise OpenAIError(503, "no decode worker is available")
    return available


async def choose_worker(state: RouterState, model: object) -> Worker:
    """The decode worker that answers for ``model`` (a request body's ``model``; absent: None)."""
    available = await _available(state)
    served = sorted({w.identity.model for w in available if w.identity.model is not None})
    if isinstance(model, str) and model:
        serving = [w for w in available if w.identity.model in (model, None)]
        if not serving:  # vLLM's own answer to a model it does not serve
            aliases = ", ".join(served)
            raise OpenAIError(404, f"The model `{model}` does not exist. Valid aliases: {aliases}.", param="model", err_type="NotFoundError")
    elif len(served) > 1:
        raise OpenAIError(400, f"this router serves several models ({', '.join(served)}): name one in \"model\"", param="model", err_type="BadRequestError")
    else:
        serving = available
    return min(serving, key=lambda w: w.inflight)


async def forward(state: RouterState, path: str, body: dict[str, Any] | None, request_id: str) -> tuple[int, bytes]:
    """The answer to ``path`` (one of :data:`AUX_PATHS`) with ``body`` (POST) as (status, JSON), from a decode worker."""
    if path == "/v1/models":
        return await _models(state, request_id)
    method = AUX_PATHS[path][0]
    worker = await choose_worker(state, (body or {}).get("model"))
    response = await _ask(state, worker, method, path, body, request_id)
    return response.status_code, response.content


async def _models(state: RouterState, request_id: str) -> tuple[int, bytes]:
    """``/v1/models`` of one worker per model (each worker whose model is unknown yet), their models in one list."""
    one_each: dict[str, Worker] = {}
    for worker in await _available(state):
        one_each.setdefault(worker.identity.model or worker.url, worker)
    answers = await asyncio.gather(*(_ask(state, w, "GET", "/v1/models", None, request_id) for w in one_each.values()))
    failed = next((a for a in answers if a.status_code != 200), None)
    if failed is not None or len(answers) == 1:
        answer = failed or answers[0]
        return answer.status_code, answer.content
    listed = [loads_strict(a.content) for a in answers]
    data = list({model["id"]: model for models in listed for model in models["data"]}.values())
    return 200, dumps({**listed[0], "data": data})


async def _ask(state: RouterState, worker: Worker, method: str, path: str, body: dict[str, Any] | None, request_id: str) -> httpx.Response:
    """``worker``'s whole answer to ``method path``; 502 when it cannot be reached."""
    try:
        return await state.upstream.request(
            method, worker.url + path, json_body=None if body is None else dumps(body), headers={"X-Request-Id": request_id}
        )
    except httpx.HTTPError as exc:
        state.registry.record_health(worker, ok=False)  # as a failed decode leg counts
        raise OpenAIError(502, f"decode worker unreachable: {type(exc).__name__}") from exc
