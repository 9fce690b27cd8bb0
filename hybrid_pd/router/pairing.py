"""Who serves a request, as one pipeline: filters -> decider -> the policy's pick.

The decode worker is chosen first: the workers that can decode (role ``decode`` or ``flex``)
that are available (healthy, not draining) and not tried yet for this request, then those
under the per-worker limit; the decode policy picks among them. The prefill candidates are
the available workers that can prefill (``prefill`` or ``flex``), other than the decode
worker, that can hand their state to it and are under the limit. The decider
(:mod:`hybrid_pd.router.decider`) then says whether the request gets a prefill leg and which
candidates qualify; the prefill policy picks among those. Having no prefill worker is not an
error: the decode worker prefills locally.

Flexible workers take the roles the planner gives them (:mod:`hybrid_pd.router.planner`,
``roles`` by worker URL): one that prefills is left out of the decode candidates (unless no
other is left), one that decodes gets its prompts from those that prefill, and one with no
role serves whole requests. A prompt outside the planner's ``split_prompts`` is served whole
by any of them (:attr:`hybrid_pd.sizing.planner.Decision.split_prompts` says why). Those bounds
are in tokens the workers count, as the planner sized them; a request's size at routing is an
estimate from its text, so ``prompt_tokens`` turns it into counted tokens first (the router's
traffic window: :meth:`hybrid_pd.sizing.traffic.TrafficWindow.prompt_tokens`). Compared raw, a
tokenizer of other than 4 bytes a token moves every prompt to one side of the bounds (on four
GPUs, 16000-token documents estimated at ~7700 were all served whole under the 3P1D sized for them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from hybrid_pd.common.logs import kv
from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.router.decider import LocalReason, SplitReason, decide
from hybrid_pd.sizing.planner import Role
from hybrid_pd.sizing.workload import Lengths
from hybrid_pd.router.policies import Policy, RequestInfo
from hybrid_pd.router.registry import DECODERS, PREFILLERS, Registry, Worker, can_pair

__all__ = ["Pairing", "PrefillChoice", "compatible_prefills"]

log = logging.getLogger("hybrid_pd.router")


@dataclass(frozen=True)
class PrefillChoice:
    """The prefill worker for a request, or None for a local prefill on the decode worker; ``reason``: the decider's why."""

    worker: Worker | None
    reason: LocalReason | SplitReason


class Pairing:
    """The pipeline over one registry, with a policy per role, the planner's roles of its flexible workers and a limit of legs in flight per worker."""

    def __init__(
        self,
        registry: Registry,
        decode_policy: Policy,
        prefill_policy: Policy,
        min_tokens: int,
        per_worker_limit: int,
        prompt_tokens: Callable[[int, bool], int],
    ) -> None:
        """``prompt_tokens``: the tokens a prompt of so many, estimated from its text or exact (token ids), counts
        (``split_prompts``' unit)."""
        self._registry = registry
        self._decode_policy = decode_policy
        self._prefill_policy = prefill_policy
        self.roles: dict[str, Role] = {}  # flexible workers' roles by URL, the planner's; none: whole requests
        self.split_prompts: Lengths | None = None  # prompt tokens (counted) the planner's split serves; others whole on any flexible worker
        self._prompt_tokens = prompt_tokens
        self._min_tokens = min_tokens
        self._limit = per_worker_limit

    def decode_available(self, tried: Collection[str] = ()) -> bool:
        """Whether a worker that can decode, other than those ``tried`` (ids), is available."""
        return any(w.available and w.id not in tried for w in self._registry.role(*DECODERS))

    def decode(self, request: RequestInfo, tried: Collection[str]) -> Worker:
        """The decode worker for ``request``, not one of those ``tried``; 503 when none is available, 429 when all are full."""
        available = [w for w in self._registry.role(*DECODERS) if w.available and w.id not in tried]
        if not available:
            raise OpenAIError(503, "no decode worker is available")
        under_limit = self._under_limit(available)
        if not under_limit:
            raise OpenAIError(429, "every decode worker is at its concurrency limit")
        if self._split(request):
            under_limit = [w for w in under_limit if self.roles.get(w.url) != "prefill"] or under_limit
        return self._decode_policy.choose(under_limit, request)

    def prefill(self, decode: Worker, request: RequestInfo) -> PrefillChoice:
        """The prefill worker for ``request`` to be decoded on ``decode``, or why it is prefilled there."""
        candidates = {w.id: w for w in self._under_limit(compatible_prefills(self._registry, decode))}
        planned = self.roles.get(decode.url) == "decode" and self._split(request)
        prefillers = {w.id for w in candidates.values() if self.roles.get(w.url) == "prefill"} if planned else ()
        decision = decide(request.est_tokens, decode.role == "flex", list(candidates), self._min_tokens, prefillers)
        if not decision.split:
            if decision.reason == "no_prefill_worker":
                log.info("no compatible prefill worker available, local prefill %s", kv(decode=decode.url))
            return PrefillChoice(None, decision.reason)
        return PrefillChoice(self._prefill_policy.choose([candidates[i] for i in decision.prefill], request), decision.reason)

    def _split(self, request: RequestInfo) -> bool:
        """Whether the planner's roles split ``request``: its prompt within the lengths they were sized for."""
        bounds = self.split_prompts
        return bounds is None or bounds.low <= self._prompt_tokens(request.est_tokens, request.exact) <= bounds.high

    def _under_limit(self, workers: Iterable[Worker]) -> list[Worker]:
        return [w for w in workers if w.inflight < self._limit]


def compatible_prefills(registry: Registry, decode: Worker) -> list[Worker]:
    """The available workers other than ``decode`` that can prefill and hand their state to it, in registration order."""
    return [w for w in registry.role(*PREFILLERS) if w.available and w is not decode and can_pair(w, decode)]
