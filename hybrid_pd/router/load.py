"""What the router sees of a worker's load, live: the decodes it runs and how slow its decoding is now.

The gap between the chunks a worker streams, averaged over the last few hundred, is the time
per output token (TPOT) its running requests see; prefills on that worker stretch it, which is
the interference a split removes (the autoscaling signal reads it, :mod:`hybrid_pd.router.autoscale`;
the planner reads the decodes in flight when it moves roles). A TPOT nobody
refreshed for a second (no stream running there) reads unknown, not stale. Times are
``time.perf_counter()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["LiveLoad", "LoadView"]

# A TPOT not refreshed for this long is unknown: the worker streams nothing now.
_TPOT_FRESH_S = 1.0
# Weight of a new chunk gap in the moving average: about the last 50 gaps count.
_TPOT_WEIGHT = 0.02


@dataclass(frozen=True)
class LoadView:
    """A worker's load at one moment, what decisions read."""

    decodes: int  # decode legs in flight
    tpot_s: float | None  # time per output token of its streams now, None when it streams nothing


@dataclass
class LiveLoad:
    """The count and the average behind :class:`LoadView`, changed by the router's leases and relays."""

    decodes: int = 0
    prefill_tokens: int = 0  # prompt tokens of the prefill legs in flight here (hybrid_pd/router/autoscale.py)
    tpot_s: float | None = None
    tpot_at: float = 0.0

    def view(self, now: float | None = None) -> LoadView:
        now = time.perf_counter() if now is None else now
        fresh = self.tpot_s is not None and now - self.tpot_at <= _TPOT_FRESH_S
        return LoadView(self.decodes, self.tpot_s if fresh else None)

    def chunk_gap(self, seconds: float, now: float) -> None:
        """The time between two chunks of one of this worker's streams."""
        self.tpot_s = seconds if self.tpot_s is None else self.tpot_s + _TPOT_WEIGHT * (seconds - self.tpot_s)
        self.tpot_at = now
