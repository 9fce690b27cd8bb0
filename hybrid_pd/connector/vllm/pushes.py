"""The hand-off's pushes, wherever an early decode leg waits for one (vLLM's engine client or the server:
:mod:`hybrid_pd.connector.vllm.handoff`; vLLM's scheduler: :mod:`hybrid_pd.connector.vllm.scheduler_hold`): their wire
form, the key of a leg that waits for one, and the pushes that came before any leg took them.

One place for these because a push may come before its leg looks for it, or for a leg that already ended, wherever
the leg waits: both keep it the same time and drop it the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from hybrid_pd.connector.contract import HANDOFF_KEY_PARAM

__all__ = ["UNCLAIMED_S", "Arrivals", "held_key", "parse_pushes"]

# Parameters that came for no request (its early leg was closed: the client left, the prefill's
# answer failed) are dropped after this long.
UNCLAIMED_S = 300.0


def held_key(params: Any) -> str | None:
    """An early decode leg's hand-off key: parameters with a key, a remote prefill and no prefill located yet; else None (a
    prefill leg names a key too, with ``do_remote_decode``)."""
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True or "remote_engine_id" in params:
        return None
    key = params.get(HANDOFF_KEY_PARAM)
    return key if isinstance(key, str) else None


def parse_pushes(body: bytes) -> list[tuple[str, dict[str, Any]]] | None:
    """A batch of pushes, (key, parameters) each, from its JSON (a list of ``{"key", "params"}``); None for anything else."""
    try:
        batch = json.loads(body)
    except ValueError:
        return None
    if not isinstance(batch, list) or not all(isinstance(p, dict) and isinstance(p.get("key"), str) and isinstance(p.get("params"), dict) for p in batch):
        return None
    return [(p["key"], p["params"]) for p in batch]


class Arrivals:
    """Pushes that came and no leg has taken yet, by key: when each came (``clock``) and its parameters; one no leg took
    in ``unclaimed_s`` is dropped (its leg ended before it came)."""

    def __init__(self, unclaimed_s: float = UNCLAIMED_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._pushes: dict[str, tuple[float, dict[str, Any]]] = {}
        self._unclaimed_s = unclaimed_s
        self._clock = clock
        self._pruned_at = clock()

    def put(self, pushes: list[tuple[str, dict[str, Any]]]) -> None:
        now = self._prune()
        for key, params in pushes:
            self._pushes[key] = (now, params)

    def take(self, key: str) -> tuple[float, dict[str, Any]] | None:
        """``key``'s push, when it came and its parameters, taken out; None while it has not come."""
        self._prune()
        return self._pushes.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._pushes

    def _prune(self) -> float:
        now = self._clock()
        if now - self._pruned_at > self._unclaimed_s:
            self._pushes = {k: v for k, v in self._pushes.items() if now - v[0] <= self._unclaimed_s}
            self._pruned_at = now
        return now
