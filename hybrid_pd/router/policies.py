"""Selection policies: pick one worker from the candidates that passed the filters.

They are the last step of :mod:`hybrid_pd.router.pairing`'s pipeline: filters
(available, compatible, under the per-worker limit) -> decider -> policy. The decode
worker is chosen first, then a prefill worker compatible with it; each role has its
own policy, set in the router's settings. ``prefix_reuse`` also reads what the router sent each
worker before (:mod:`hybrid_pd.router.prefix_index`), for multi-turn chat and shared system prompts.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from hybrid_pd.router.prefix_index import prefix_chain, reusable_tokens
from hybrid_pd.router.registry import Worker

__all__ = ["POLICIES", "PREFIX_OUTCOMES", "Policy", "PolicyContext", "PrefixOutcome", "RequestInfo", "make_policy"]


class RequestInfo:
    """What policies may look at: the prompt's estimated size and an affinity key.

    The key is given (the OpenAI ``user`` field) or cut from the prompt's start the first
    time a policy reads it: only ``prefix_affinity`` does, and for a token-id prompt the cut
    joins hundreds of ids, a cost every other policy would pay for nothing.
    """

    __slots__ = ("est_tokens", "_key", "_prompt", "_prefix_chars", "_chain")

    def __init__(
        self, est_tokens: int, affinity_key: str | None = None, prompt: str | Sequence[int] = "", prefix_chars: int = 256
    ) -> None:
        self.est_tokens = est_tokens
        self._key = affinity_key
        self._prompt = prompt
        self._prefix_chars = prefix_chars
        self._chain: list[int] | None = None

    @property
    def exact(self) -> bool:
        """Whether ``est_tokens`` is counted, not estimated: the prompt is token ids."""
        return not isinstance(self._prompt, str)

    @classmethod
    def from_body(cls, body: dict[str, Any], prefix_chars: int = 256) -> RequestInfo:
        """The OpenAI ``user`` field, else the prompt's first ``prefix_chars`` characters, is the key.

        Size is exact for token-id prompts and estimated at 4 bytes a token for text.
        """
        user = str(body["user"]) if body.get("user") else None
        if "messages" in body:
            messages = body["messages"] if isinstance(body["messages"], list) else []  # vLLM rejects the rest
            text = "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            return cls(len(text.encode()) // 4, user, text, prefix_chars)
        prompt = body.get("prompt", "")
        # map() checks the ids in C: a generator expression costs twice as much over a long prompt.
        if isinstance(prompt, list) and all(map(isinstance, prompt, itertools.repeat(int))):
            return cls(len(prompt), user, prompt, prefix_chars)
        text = str(prompt)
        return cls(len(text.encode()) // 4, user, text, prefix_chars)

    @property
    def affinity_key(self) -> str:
        """The ``user`` field, else the prompt's first ``prefix_chars`` characters (token ids joined by spaces)."""
        if self._key is None:
            prompt, n = self._prompt, self._prefix_chars
            self._key = prompt[:n] if isinstance(prompt, str) else " ".join(map(str, prompt[:n]))[:n]
        return self._key

    @property
    def prefix_chain(self) -> list[int]:
        """The prompt's grain hashes (:func:`hybrid_pd.router.prefix_index.prefix_chain`), cut the first time ``prefix_reuse`` reads them."""
        if self._chain is None:
            self._chain = prefix_chain(self._prompt)
        return self._chain


class Policy(Protocol):
    def choose(self, candidates: list[Worker], request: RequestInfo) -> Worker: ...


class RoundRobin:
    """Each candidate in turn."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Worker], request: RequestInfo) -> Worker:
        ordered = sorted(candidates, key=lambda w: w.url)
        return ordered[next(self._counter) % len(ordered)]


class LeastOutstanding:
    """Fewest in-flight requests, then fewest in-flight prompt tokens."""

    def choose(self, candidates: list[Worker], request: RequestInfo) -> Worker:
        return min(candidates, key=lambda w: (w.inflight, w.inflight_tokens, w.url))


class PowerOfTwo:
    """Two candidates at random, the less loaded of them: near least-outstanding without herding."""

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def choose(self, candidates: list[Worker], request: RequestInfo) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._random.sample(candidates, 2)
        return min((a, b), key=lambda w: (w.inflight, w.inflight_tokens))


class PrefixAffinity:
    """Consistent hashing of the affinity key, so repeated prefixes (or users) land on one worker.

    A worker leaving moves only its own keys. With ``vnodes`` points per worker the
    load spreads evenly.
    """

    def __init__(self, vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._rings: dict[tuple[str, ...], list[tuple[int, str]]] = {}

    @staticmethod
    def _hash(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

    def choose(self, candidates: list[Worker], request: RequestInfo) -> Worker:
        urls = tuple(sorted(w.url for w in candidates))
        ring = self._rings.get(urls)
        if ring is None:
            ring = sorted((self._hash(f"{url}#{i}"), url) for url in urls for i in range(self.vnodes))
            self._rings = {urls: ring}  # one worker set at a time: recomputed when it changes
        by_url = {w.url: w for w in candidates}
        point = bisect.bisect(ring, (self._hash(request.affinity_key), "")) % len(ring)
        return by_url[ring[point][1]]


# How a prefix_reuse choice went: the worker that can resume most, none could resume any, or a
# less loaded one because the best was too busy.
PrefixOutcome = Literal["hit", "miss", "balanced"]
PREFIX_OUTCOMES: tuple[PrefixOutcome, ...] = get_args(PrefixOutcome)


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may need beyond the candidates: only ``prefix_reuse`` reads it.

    ``report(outcome, reusable_tokens)`` is told each choice (the router's metrics).
    """

    index_tokens: int = 1_000_000
    load_slack: int = 4
    report: Callable[[PrefixOutcome, int], None] = lambda outcome, tokens: None


class PrefixReuse:
    """The candidate that can resume the longest part of the prompt from a state checkpoint, unless it is too busy.

    What each worker can resume is the prefix the router sent it before, rounded down to the
    granule its vLLM reports (:mod:`hybrid_pd.router.prefix_index`): for a hybrid, matching
    attention blocks past the last state checkpoint reuse nothing, and a worker with prefix
    caching off reuses nothing at all. When no candidate can resume a checkpoint, or the best
    has more than ``load_slack`` legs in flight above the least loaded (one hot conversation or
    system prompt must not pin a worker), the least loaded takes it, as ``least_outstanding``
    would; it then holds the prefix too, and later turns spread over both.
    """

    def __init__(self, context: PolicyContext | None = None) -> None:
        self._context = context or PolicyContext()
        self._least = LeastOutstanding()

    def choose(self, candidates: list[Worker], request: RequestInfo) -> Worker:
        chain = request.prefix_chain
        reusable = {
            w.id: reusable_tokens(w.prefixes.matched_grains(chain), request.est_tokens, w.identity.prefix_hit_tokens) for w in candidates
        }
        least = self._least.choose(candidates, request)
        best = max(candidates, key=lambda w: (reusable[w.id], -w.inflight, -w.inflight_tokens))
        if reusable[best.id] == 0:
            pick, outcome = least, "miss"
        elif best.inflight - least.inflight > self._context.load_slack:
            pick, outcome = least, "balanced"
        else:
            pick, outcome = best, "hit"
        pick.prefixes.record(chain, self._context.index_tokens)
        self._context.report(outcome, reusable[pick.id])
        return pick


POLICIES = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "power_of_two": PowerOfTwo,
    "prefix_affinity": PrefixAffinity,
    "prefix_reuse": PrefixReuse,
}


def make_policy(name: str, context: PolicyContext | None = None) -> Policy:
    """The policy called ``name`` (``context``: what ``prefix_reuse`` reads); ValueError names the choices."""
    if name == "prefix_reuse":
        return PrefixReuse(context)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
