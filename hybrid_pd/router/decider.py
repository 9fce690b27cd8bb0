"""Disaggregate this request or not: a pure decision over its decode worker's role and the prefill candidates.

- a prompt shorter than ``min_tokens`` is prefilled where it is decoded (``short_prompt``);
- a dedicated decode worker (role ``decode``) gets its prompts from a prefill worker
  (``disaggregated``), or prefills itself when none is available (``no_prefill_worker``);
- a flexible worker (role ``flex``, vLLM's ``kv_both``) serves the request whole, as a
  colocated replica does (``replica``), unless the planner (:mod:`hybrid_pd.router.planner`)
  has it decode for flexible workers that prefill: then one of those prefills it (``planner``).

The decision names the candidates the prefill policy may pick from (empty: local) and why;
the router counts each reason and logs it with the request id.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["LOCAL_REASONS", "SPLIT_REASONS", "Decision", "LocalReason", "SplitReason", "decide"]

# Why a request is prefilled where it is decoded (``prefill_failed`` is the route's: the leg was sent and failed).
LocalReason = Literal["short_prompt", "no_prefill_worker", "replica", "prefill_failed"]
# Why it is prefilled on another worker.
SplitReason = Literal["disaggregated", "planner"]
LOCAL_REASONS: tuple[str, ...] = get_args(LocalReason)
SPLIT_REASONS: tuple[str, ...] = get_args(SplitReason)


@dataclass(frozen=True)
class Decision:
    """``prefill``: the candidates' ids the prefill policy picks from, empty for a local prefill; ``reason``: why."""

    prefill: tuple[str, ...]
    reason: LocalReason | SplitReason

    @property
    def split(self) -> bool:
        return bool(self.prefill)


def decide(tokens: int, flexible: bool, candidates: Sequence[str], min_tokens: int, prefillers: Collection[str]) -> Decision:
    """Where a prompt of ``tokens`` (estimated) is prefilled, given the ids of the prefill ``candidates`` that passed the filters.

    ``flexible``: the decode worker is a flexible one; ``prefillers``: the ids of the flexible
    workers the planner has prefilling for it (empty: it serves whole requests).
    """
    if tokens < min_tokens:
        return Decision((), "short_prompt")
    if not candidates:
        return Decision((), "no_prefill_worker")
    if flexible:
        planned = tuple(c for c in candidates if c in prefillers)
        return Decision(planned, "planner") if planned else Decision((), "replica")
    return Decision(tuple(candidates), "disaggregated")
