"""What the router sees of a worker's load, live: decodes it runs, prompt tokens it has still to prefill, how fast it goes.

The adaptive decider (:mod:`hybrid_pd.router.decider`) needs two things no policy read before:

- how long a prompt sent to a worker now would wait for its first token. A worker drains the
  prompt tokens ahead of a new one at some rate R; a prefill that found ``Q`` tokens ahead of
  its own ``p`` and took ``d`` seconds says R ~ (Q + p) / d. The router keeps that estimate
  per worker from the prefill legs it runs (and the local prefills, timed to their first byte),
  so the wait of a new prompt is (tokens ahead + its own) / R.
- how slow the worker's decoding is now: the gap between the chunks it streams, averaged
  over the last few hundred, is the time per output token its running requests see.
  Prefills on that worker stretch it; that is the interference disaggregation removes.

Both are exponentially weighted moving averages; a TPOT nobody refreshed for a second
(no stream running there) reads unknown, not stale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Ewma", "LiveLoad", "LoadView"]

# A TPOT not refreshed for this long is unknown: the worker streams nothing now.
_TPOT_FRESH_S = 1.0


@dataclass
class Ewma:
    """An exponentially weighted moving average; None until its first sample."""

    weight: float
    value: float | None = None
    updated: float = 0.0

    def add(self, sample: float, now: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)
        self.updated = now


@dataclass(frozen=True)
class LoadView:
    """A worker's load at one moment, what decisions read (:mod:`hybrid_pd.router.decider`)."""

    decodes: int  # decode legs in flight
    prefill_tokens: int  # prompt tokens in flight that it has not prefilled yet
    prefill_tokens_per_s: float | None  # the rate it drains them, None before its first prefill
    tpot_s: float | None  # time per output token of its streams now, None when it streams nothing

    def prefill_wait_s(self, tokens: int) -> float | None:
        """Seconds until a prompt of ``tokens`` sent now would be prefilled; None when the rate is not known yet."""
        if not self.prefill_tokens_per_s:
            return None
        return (self.prefill_tokens + tokens) / self.prefill_tokens_per_s


@dataclass
class LiveLoad:
    """The counts and averages behind :class:`LoadView`, changed by the router's leases and relays."""

    decodes: int = 0
    prefill_tokens: int = 0
    prefill_rate: Ewma = field(default_factory=lambda: Ewma(0.2))
    tpot: Ewma = field(default_factory=lambda: Ewma(0.02))

    def view(self, now: float | None = None) -> LoadView:
        now = time.perf_counter() if now is None else now
        fresh = self.tpot.value is not None and now - self.tpot.updated <= _TPOT_FRESH_S
        return LoadView(self.decodes, self.prefill_tokens, self.prefill_rate.value, self.tpot.value if fresh else None)

    def prefill_started(self, tokens: int) -> int:
        """A prompt of ``tokens`` queued here; returns the tokens that were ahead of it."""
        ahead = self.prefill_tokens
        self.prefill_tokens += tokens
        return ahead

    def prefill_done(self, tokens: int, ahead: int, seconds: float, ok: bool, now: float | None = None) -> None:
        """The prompt left the queue; when it was prefilled (``ok``), its time is a sample of the drain rate."""
        self.prefill_tokens -= tokens
        if ok and seconds > 0:
            self.prefill_rate.add((ahead + tokens) / seconds, time.perf_counter() if now is None else now)

    def chunk_gap(self, seconds: float, now: float) -> None:
        """The time between two chunks of one of this worker's streams; ``now``: ``time.perf_counter()``, the clock of every time here."""
        self.tpot.add(seconds, now)
