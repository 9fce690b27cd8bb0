"""The two legs of a disaggregated request, as pure functions over JSON bodies.

vLLM's NIXL pull protocol: the prefill worker runs the prompt with
``max_tokens=1`` and ``do_remote_decode``; it answers with ``kv_transfer_params``
that tell the decode worker where to read the state. The decode worker gets the
client's own request plus those parameters, unchanged, and pulls the state over
NIXL. For hybrid models the prefill stops at token N-1 and the decode worker
recomputes token N, so the token the prefill samples is never shown to the client.

An early decode leg (:func:`early_decode_body`) is sent with the prefill leg, before there are
parameters to give it: both legs carry one key (``hybrid_pd_handoff_key``), and the prefill leg
the decode worker's URL, where the prefill's engine pushes its parameters the moment it ends
(``hybrid_pd/connector/vllm/handoff.py`` says why). Both workers must take part.

Both legs' ``kv_transfer_params`` also carry the router's id of the leg
(:data:`~hybrid_pd.connector.trace.timeline.REQUEST_ID_PARAM`): vLLM renames a request inside its engine,
and the hand-off timeline (``hybrid_pd/connector/vllm/timeline_engine.py``) names the engine's events by
the router's id. vLLM's connector ignores keys it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid_pd.connector.contract import HANDOFF_KEY_PARAM, HANDOFF_URL_PARAM
from hybrid_pd.connector.trace.timeline import REQUEST_ID_PARAM
from hybrid_pd.router.jsoncodec import ENCODER, dumps

__all__ = ["PREFILL_KV_TRANSFER_PARAMS", "Handoff", "LegEncoder", "decode_body", "early_decode_body", "prefill_body"]

# What the prefill leg asks for: keep the state for a remote decode worker to pull.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Fields of the client's request that make no sense for a one-token, non-streamed prefill.
_DROPPED_FOR_PREFILL = ("stream", "stream_options", "min_tokens")


@dataclass(frozen=True)
class Handoff:
    """An early decode leg's pairing: the key both legs carry, and where the prefill pushes to (the decode worker's URL, or
    its engine's inbox, ``tcp://host:port``, where its scheduler holds early legs)."""

    key: str
    decode_url: str


def prefill_body(body: dict[str, Any], request_id: str | None = None, handoff: Handoff | None = None) -> dict[str, Any]:
    """The prefill leg's request: the client's request cut to one token, not streamed; ``request_id``: the leg's."""
    out = {k: v for k, v in body.items() if k not in _DROPPED_FOR_PREFILL}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    params = {**PREFILL_KV_TRANSFER_PARAMS, **({} if request_id is None else {REQUEST_ID_PARAM: request_id})}
    if handoff is not None:
        params[HANDOFF_KEY_PARAM], params[HANDOFF_URL_PARAM] = handoff.key, handoff.decode_url
    out["kv_transfer_params"] = params
    return out


def early_decode_body(body: dict[str, Any], handoff: Handoff, request_id: str | None = None) -> dict[str, Any]:
    """The decode leg sent with the prefill leg: the client's request, waiting in the decode engine for ``handoff.key``'s parameters."""
    params = {"do_remote_prefill": True, HANDOFF_KEY_PARAM: handoff.key}
    if request_id is not None:
        params[REQUEST_ID_PARAM] = request_id
    return {**body, "kv_transfer_params": params}


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None, request_id: str | None = None) -> dict[str, Any]:
    """The decode leg's request: the client's request plus the prefill's transfer parameters (and ``request_id``, the leg's).

    Without parameters (the prefill had no state to hand over) the decode worker
    prefills locally; the client's request goes as it came.
    """
    if kv_transfer_params is None:
        return dict(body)
    if request_id is not None:
        kv_transfer_params = {**kv_transfer_params, REQUEST_ID_PARAM: request_id}
    return {**body, "kv_transfer_params": kv_transfer_params}


class LegEncoder:
    """JSON bodies for the legs of one client request, its prompt encoded once for all of them.

    The prompt (``prompt``, or a chat's ``messages``) is most of a request's bytes and both legs
    send it unchanged: a leg whose prompt is the client's own object gets that encoding spliced
    in after its other fields (the order of a JSON object's fields carries no meaning); any other
    body is encoded whole.
    """

    __slots__ = ("_key", "_prompt", "_encoded")

    def __init__(self, body: dict[str, Any]) -> None:
        self._key = "prompt" if "prompt" in body else "messages" if "messages" in body else None
        self._prompt = body.get(self._key) if self._key else None
        self._encoded: str | None = None

    def encode(self, leg: dict[str, Any]) -> bytes:
        """``leg`` as compact UTF-8 JSON (``ValueError`` for NaN or Infinity, ``TypeError`` for what JSON cannot hold)."""
        key = self._key
        if key is None or key not in leg or leg[key] is not self._prompt:
            return dumps(leg)
        if self._encoded is None:
            self._encoded = ENCODER.encode(self._prompt)
        rest = ENCODER.encode({k: v for k, v in leg.items() if k != key})
        separator = "," if len(leg) > 1 else ""
        return f'{rest[:-1]}{separator}"{key}":{self._encoded}}}'.encode()

