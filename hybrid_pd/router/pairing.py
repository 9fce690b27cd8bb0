"""Who serves a request, as one pipeline: filters -> decider -> the policy's pick.

The decode worker is chosen first: the decode workers that are available (healthy, not
draining) and not tried yet for this request, then those under the per-worker limit; the
decode policy picks among them. The decider then says whether the request gets a prefill
leg at all. If it does, the candidates are the available prefill workers that can hand their
state to that decode worker and are under the limit; the prefill policy picks. Having no
prefill worker is not an error: the decode worker prefills locally.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

from hybrid_pd.common.logs import kv
from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.router.policies import Policy, RequestInfo
from hybrid_pd.router.registry import Registry, Worker, can_pair

__all__ = ["Fallback", "Pairing", "PrefillChoice", "PromptLengthDecider", "compatible_prefills"]

log = logging.getLogger("hybrid_pd.router")

# Why a request has no prefill leg: its ``reason`` label in ``hybrid_pd_fallbacks``. Pairing gives
# the first two; ``prefill_failed`` is the route's (the leg was sent and failed).
Fallback = Literal["short_prompt", "no_prefill_worker", "prefill_failed"]


@dataclass(frozen=True)
class PromptLengthDecider:
    """Disaggregate a request unless its prompt is estimated shorter than ``below_tokens``.

    A short prompt costs the decode worker little to prefill, less than a transfer would.
    Its input is :class:`RequestInfo`, where more of what a decision needs (the decode
    worker's cached prefix, say) can be added.
    """

    below_tokens: int

    def disaggregate(self, request: RequestInfo) -> bool:
        return request.est_tokens >= self.below_tokens


@dataclass(frozen=True)
class PrefillChoice:
    """The prefill worker for a request, or, when there is none, why (the decode worker prefills locally)."""

    worker: Worker | None
    fallback: Fallback | None = None


class Pairing:
    """The pipeline over one registry, with a policy per role and a limit of legs in flight per worker."""

    def __init__(
        self, registry: Registry, decode_policy: Policy, prefill_policy: Policy, decider: PromptLengthDecider, per_worker_limit: int
    ) -> None:
        self._registry = registry
        self._decode_policy = decode_policy
        self._prefill_policy = prefill_policy
        self._decider = decider
        self._limit = per_worker_limit

    def decode_available(self, tried: Collection[str] = ()) -> bool:
        """Whether a decode worker other than those ``tried`` (ids) is available."""
        return any(w.available and w.id not in tried for w in self._registry.role("decode"))

    def decode(self, request: RequestInfo, tried: Collection[str]) -> Worker:
        """The decode worker for ``request``, not one of those ``tried``; 503 when none is available, 429 when all are full."""
        available = [w for w in self._registry.role("decode") if w.available and w.id not in tried]
        if not available:
            raise OpenAIError(503, "no decode worker is available")
        under_limit = self._under_limit(available)
        if not under_limit:
            raise OpenAIError(429, "every decode worker is at its concurrency limit")
        return self._decode_policy.choose(under_limit, request)

    def prefill(self, decode: Worker, request: RequestInfo) -> PrefillChoice:
        """The prefill worker for ``request`` to be decoded on ``decode``, if the decider wants one and one is free."""
        if not self._decider.disaggregate(request):
            return PrefillChoice(None, "short_prompt")
        candidates = self._under_limit(compatible_prefills(self._registry, decode))
        if not candidates:
            log.info("no compatible prefill worker available, local prefill %s", kv(decode=decode.url))
            return PrefillChoice(None, "no_prefill_worker")
        return PrefillChoice(self._prefill_policy.choose(candidates, request))

    def _under_limit(self, workers: Iterable[Worker]) -> list[Worker]:
        return [w for w in workers if w.inflight < self._limit]


def compatible_prefills(registry: Registry, decode: Worker) -> list[Worker]:
    """The available prefill workers that can hand their state to ``decode``, in registration order."""
    return [w for w in registry.role("prefill") if w.available and can_pair(w, decode)]
