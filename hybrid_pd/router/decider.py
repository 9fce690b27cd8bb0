"""Disaggregate this request or not: a pure decision over the live load of its decode worker and the prefill candidates.

Disaggregation pays where a prefill would stall decoding: a prompt prefilled on a worker that
is decoding stretches every running request's time per output token (TPOT). It costs where
the prefill side is the bottleneck (the prompt waits there while the decode worker could have
prefilled it) and, a little, in the hand-off itself. So the router decides per request, from
what it measures (:mod:`hybrid_pd.router.load`) and the SLOs it is given:

- a prompt shorter than ``min_tokens`` is prefilled where it is decoded (``short_prompt``);
- a dedicated decode worker (role ``decode``) gets its prompts from a prefill worker
  (``disaggregated``) unless every candidate's queue would hold the prompt past the TTFT SLO
  while the decode worker has TPOT headroom: then it prefills locally (``prefill_queue``),
  Dynamo's conditional disaggregation by live load;
- a flexible worker (role ``flex``, vLLM's ``kv_both``) prefills its own prompts, as a
  colocated replica does (``decode_headroom``), until its streams' TPOT reaches
  ``split_above`` of the TPOT SLO; then the prompt goes to a worker decoding fewer requests
  (``decode_pressure``), which moves the stall off the busy decoders. Without a TPOT SLO a
  flexible worker never splits: the same GPUs serve as replicas.

The decision names the candidates the prefill policy may pick from (empty: local) and why;
the router counts each reason and logs it with the request id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from hybrid_pd.router.load import LoadView

__all__ = ["LOCAL_REASONS", "SPLIT_REASONS", "Candidate", "Decision", "Slo", "decide"]

# Why a request is prefilled where it is decoded (``prefill_failed`` is the route's: the leg was sent and failed).
LocalReason = Literal["short_prompt", "no_prefill_worker", "prefill_queue", "decode_headroom", "prefill_failed"]
# Why it is prefilled on another worker.
SplitReason = Literal["disaggregated", "decode_pressure"]
LOCAL_REASONS: tuple[str, ...] = get_args(LocalReason)
SPLIT_REASONS: tuple[str, ...] = get_args(SplitReason)


@dataclass(frozen=True)
class Slo:
    """The latency targets the router serves to: TTFT and TPOT in seconds (None: no target)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    split_above: float = 0.5  # a flexible worker splits once its TPOT reaches this share of ``tpot_s``

    def tpot_pressed(self, load: LoadView) -> bool:
        """Whether ``load``'s streams are close enough to the TPOT target that a local prefill would cost it."""
        return self.tpot_s is not None and load.tpot_s is not None and load.tpot_s >= self.split_above * self.tpot_s


@dataclass(frozen=True)
class Candidate:
    """A prefill worker that passed the filters (available, compatible, under its limit, not the decode worker)."""

    id: str
    load: LoadView


@dataclass(frozen=True)
class Decision:
    """``prefill``: the candidates' ids the prefill policy picks from, empty for a local prefill; ``reason``: why."""

    prefill: tuple[str, ...]
    reason: LocalReason | SplitReason

    @property
    def split(self) -> bool:
        return bool(self.prefill)


def decide(tokens: int, decode: LoadView, flexible: bool, candidates: Sequence[Candidate], slo: Slo, min_tokens: int) -> Decision:
    """Where a prompt of ``tokens`` (estimated) to be decoded on a worker with ``decode``'s load is prefilled.

    ``flexible``: the decode worker can prefill for itself as well as for others (role ``flex``).
    """
    if tokens < min_tokens:
        return Decision((), "short_prompt")
    if not candidates:
        return Decision((), "no_prefill_worker")
    if flexible:
        if not slo.tpot_pressed(decode):
            return Decision((), "decode_headroom")
        candidates = [c for c in candidates if c.load.decodes < decode.decodes]
        if not candidates:
            return Decision((), "decode_headroom")
        reason: SplitReason = "decode_pressure"
    else:
        reason = "disaggregated"
    if slo.ttft_s is not None:
        in_time = [c for c in candidates if _within(c.load.prefill_wait_s(tokens), slo.ttft_s)]
        if not in_time:
            if not slo.tpot_pressed(decode) and _sooner(decode.prefill_wait_s(tokens), candidates, tokens):
                return Decision((), "prefill_queue")
            soonest = min(c.load.prefill_wait_s(tokens) or 0.0 for c in candidates)
            in_time = [c for c in candidates if (c.load.prefill_wait_s(tokens) or 0.0) <= soonest]
        candidates = in_time
    return Decision(tuple(c.id for c in candidates), reason)


def _within(wait_s: float | None, target_s: float) -> bool:
    return wait_s is None or wait_s <= target_s


def _sooner(local_wait_s: float | None, candidates: Sequence[Candidate], tokens: int) -> bool:
    """Whether prefilling here beats every candidate's queue (a worker that never prefilled counts as no wait)."""
    if local_wait_s is None:
        return True
    return all(local_wait_s < (c.load.prefill_wait_s(tokens) or 0.0) for c in candidates)
