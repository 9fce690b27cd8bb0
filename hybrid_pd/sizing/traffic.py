"""What a router measures of the live traffic for the planner: lengths and load over a sliding window, and when it changed.

The lengths are those of the requests that *arrived* in the window, so the planner sees a new
traffic as it comes in, not once its slow requests are done (a 16000-token document under the
wrong layout takes seconds to finish). At arrival the router knows only the client's text and
``max_tokens``; each request's usage, when its answer is done, says what the workers counted,
and the ratios of counted to estimated (the first answer's, then a moving average) scale the
estimates of the arrivals. The load is the time-weighted mean of the requests in flight, what
``vllm bench serve --max-concurrency`` holds fixed and the simulator's closed loop reproduces.

A traffic that changes phase (chat, then long documents) would fill the window with both for its
length, and the planner would size for a mix that is neither (on four H100s it stopped at 2P2D for
2-4 s on the way from whole requests to 3P1D and back). So when the arrivals of the last
``recent_s`` differ from the window's older ones by more than :data:`SHIFT` in median prompt or
output length, the summary is of the last ``recent_s`` alone, and so are the next ones from that
point on: the window starts again at the shift. Otherwise, a period later, the new phase's
arrivals outnumber the old ones in the older part of the window, no shift shows, and the planner
sizes for the mix again (simulated, chat -> documents -> chat on four H100s flipped to 3P1D and
back within 4 s of the second chat phase).

The load shifts too: a mean of requests in flight over the last ``recent_s`` :data:`SHIFT` times the
older part's, or a share of it, is a new phase as well (above :data:`LOAD_FLOOR`), measured from its
first arrival or end after the period's start, and a pause (nothing in flight for a period) ends a phase: the window starts
again at the first arrival after it. Over a whole window, a wave after a pause reads as a
fraction of itself (the four-GPU run's phases began after ~20 s pauses: 128 chat requests in flight
read as 64-80 a period in, as the planner's prediction then says, and it went from 3P1D through whole
requests to 1P3D), and a load that
halves reads high for a window (simulated, chat at 128 then 32 in flight: 1P3D kept 7 s into the
lighter phase).

Each arrival keeps the SLO pair its request asked for (the router's when it named none), and the
summary sizes for the pair most asked (:func:`~hybrid_pd.sizing.planner.traffic_of`); another pair
most asked in the last ``recent_s`` is a shift too (the same chat, now with a looser target).

Several routers in front of the same workers each see part of the traffic; the one that decides
sizes for all of it: each shares its window as ages (:meth:`TrafficWindow.view`, lengths already
corrected) and :meth:`TrafficWindow.merged` makes one window of them, the requests in flight summed.

Kept with the simulator, which measures its simulated traffic with the same class
(:mod:`hybrid_pd.sizing.planned`): the router and the simulation size by the same numbers. Pure:
the caller gives the times (``time.perf_counter()`` on the router, simulated seconds in the
simulation). O(1) per request; the summary walks the window.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from hybrid_pd.sizing.planner import Traffic, most_asked, traffic_of
from hybrid_pd.sizing.workload import SLO

__all__ = ["LOAD_FLOOR", "SHIFT", "TrafficWindow", "WindowView"]

# Weight of one request's counted/estimated ratio in the moving average: about the last 20 count.
_RATIO_WEIGHT = 0.05
# A median length, or mean requests in flight, this many times the older part's (or a share of it) is a new phase of the traffic.
SHIFT = 2.0
# Loads below this many requests in flight never make a shift: over a period their mean is mostly noise (a closed loop of 4
# reads 2-6 as requests end and the next arrive), and flexible workers serve them alike in any layout.
LOAD_FLOOR = 4.0


@dataclass(frozen=True)
class WindowView:
    """One router's window as it shares it with its peers: times as seconds before now, lengths corrected by its ratios."""

    arrived: tuple[tuple[float, int, int, SLO | None], ...]  # (seconds ago, prompt tokens, output tokens, SLO asked)
    inflight: tuple[tuple[float, int], ...]  # (seconds ago, requests in flight from then on), oldest first


@dataclass
class TrafficWindow:
    """The last ``seconds`` of traffic: the requests that arrived (their estimated lengths) and the requests in flight over time."""

    seconds: float
    recent_s: float  # the part a shift is looked for in: the planner's period
    prompt_ratio: float = 1.0  # prompt tokens counted / estimated from the text
    output_ratio: float = 1.0  # completion tokens counted / max_tokens asked
    # (when, prompt tokens as estimated from the text or, ``exact``, counted (token ids), max_tokens, SLO)
    _arrived: deque[tuple[float, int, int, SLO | None, bool]] = field(default_factory=deque)
    _changes: deque[tuple[float, int]] = field(default_factory=deque)  # (when, requests in flight from then on)
    _inflight: int = 0
    _prompt_counted_at: float = -math.inf  # when a prompt's tokens were last counted (an answer's usage, or a sample's count)
    _sample_asked_at: float = -math.inf  # when a sample was last asked for (:meth:`sample_prompt`)
    _outputs_counted: bool = False  # an answer's usage has set the output ratio
    _phase_start: float = -math.inf  # where the last shift was seen: what came before is another phase

    def started(self, now: float, prompt_estimate: int, max_tokens: int, slo: SLO | None = None, exact: bool = False) -> None:
        """A request arrived, asking for ``slo`` (None: no pair of its own); ``exact``: its prompt is token ids, counted."""
        self._inflight += 1
        self._changes.append((now, self._inflight))
        self._arrived.append((now, max(1, prompt_estimate), max(1, max_tokens), slo, exact))

    def ended(
        self, now: float, prompt_estimate: int, max_tokens: int, prompt_tokens: int | None, completion_tokens: int | None, exact: bool = False
    ) -> None:
        """A request left; its usage, when it told the tokens (a failed or refused one tells nothing), corrects the estimates
        (a prompt of token ids only the outputs': its own length was exact, and says nothing of how the text counts)."""
        self._inflight -= 1
        self._changes.append((now, self._inflight))
        if prompt_tokens and completion_tokens:
            if not exact:
                self.prompt_counted(now, prompt_estimate, prompt_tokens)
            weight = _RATIO_WEIGHT if self._outputs_counted else 1.0
            self.output_ratio += weight * (completion_tokens / max(1, max_tokens) - self.output_ratio)
            self._outputs_counted = True

    def prompt_counted(self, now: float, prompt_estimate: int, prompt_tokens: int) -> None:
        """A prompt estimated at ``prompt_estimate`` counts ``prompt_tokens`` (its answer's usage, or a worker's count of a
        sample): the ratio that corrects the estimates takes it in (the first count sets it)."""
        weight = _RATIO_WEIGHT if self._prompt_counted_at > -math.inf else 1.0
        self.prompt_ratio += weight * (prompt_tokens / max(1, prompt_estimate) - self.prompt_ratio)
        self._prompt_counted_at = now

    def sample_prompt(self, now: float) -> bool:
        """Whether a worker should count the prompt of a request arriving ``now`` (noted as asked when so): none was counted
        or asked for in the last ``recent_s``. Usage comes only when an answer ends, so after a start or a pause the
        estimates would stay uncorrected for an answer's whole length (on four GPUs the planner's first move waited ~5 s
        for it); in steady traffic the answers keep counting and no sample is asked."""
        if now - max(self._prompt_counted_at, self._sample_asked_at) <= self.recent_s:
            return False
        self._sample_asked_at = now
        return True

    def prompt_tokens(self, estimate: int, exact: bool = False) -> int:
        """The tokens a prompt estimated at ``estimate`` from its text counts, by the counts so far (``exact``: token ids,
        already counted): the unit the planner sizes in, so also that of its ``split_prompts``, which the router compares
        each request's estimate with."""
        return estimate if exact else round(estimate * self.prompt_ratio)

    def view(self, now: float) -> WindowView:
        """The window as a peer merges it (:meth:`merged`)."""
        self._forget(now - self.seconds)
        arrived = tuple((now - when, self.prompt_tokens(p, exact), round(o * self.output_ratio), slo) for when, p, o, slo, exact in self._arrived)
        return WindowView(arrived, tuple((now - when, inflight) for when, inflight in self._changes))

    @classmethod
    def merged(cls, views: list[WindowView], seconds: float, recent_s: float, now: float) -> TrafficWindow:
        """One window of several routers' views at ``now``: every arrival, and the requests in flight of all of them summed."""
        window = cls(seconds, recent_s)
        # Already corrected by each router: counted tokens, as exact as token ids.
        window._arrived.extend(sorted(((now - age, p, o, slo, True) for view in views for age, p, o, slo in view.arrived), key=lambda a: a[0]))
        levels = [0] * len(views)
        for age, i, inflight in sorted(((age, i, n) for i, view in enumerate(views) for age, n in view.inflight), key=lambda c: -c[0]):
            levels[i] = inflight
            window._changes.append((now - age, sum(levels)))
        return window

    def summary(self, now: float) -> Traffic | None:
        """The traffic to size for (lengths as 10th-90th percentiles of the arrivals, corrected): the window's, or the last
        ``recent_s``'s after a shift; None before any arrival in the window."""
        since = now - self.seconds
        self._forget(since)
        if not self._changes:
            return None
        # A router whose traffic began inside the window has seen only part of it: over the whole window, 128 requests in
        # flight for 2 s would read as 25 (the GPU run: the planner moved only once the window had filled).
        start = max(since, self._changes[0][0], self._phase_start, self._after_pause())
        boundary = now - self.recent_s
        if boundary > start and self._shifted(boundary, start, now):
            # The new phase from its first arrival or end: a wave after a pause is not measured with the pause.
            start = self._phase_start = next((when for when, _ in self._changes if when >= boundary), boundary)
        if now <= start:
            return None
        arrived = [(self.prompt_tokens(p, exact), round(o * self.output_ratio), slo) for when, p, o, slo, exact in self._arrived if when >= start]
        return traffic_of(arrived, self._mean_inflight(start, now), now - start)

    def _after_pause(self) -> float:
        """The first arrival after the window's last pause (nothing in flight for a period or more); -inf without one.

        What came before a pause is another phase: a wave after one, measured with it, reads as a fraction of itself.
        """
        after, idle_since = -math.inf, None
        for when, inflight in self._changes:
            if idle_since is not None and when - idle_since >= self.recent_s:
                after = when
            idle_since = when if inflight == 0 else None
        return after

    def _forget(self, since: float) -> None:
        """Drop what happened before ``since``, but the requests in flight then (the change in force at ``since`` stays)."""
        while self._arrived and self._arrived[0][0] < since:
            self._arrived.popleft()
        while len(self._changes) > 1 and self._changes[1][0] <= since:
            self._changes.popleft()

    def _shifted(self, boundary: float, start: float, now: float) -> bool:
        """Whether the traffic after ``boundary`` differs from that between ``start`` and it by :data:`SHIFT` in mean requests
        in flight (where either reaches :data:`LOAD_FLOOR` and the older part is half a period or longer), in median prompt or
        output of the arrivals, or in the SLO pair most asked."""
        # A load is compared with half a period or more before it: against a wave's first instants the rest of the wave
        # reads as a new load, and the window would restart at its last arrivals (on four H100s, at the last 3 of 32
        # documents, too few to size: the planner moved 6.5 s into the documents instead of 2).
        if boundary - start >= self.recent_s / 2:
            older_load, newer_load = self._mean_inflight(start, boundary), self._mean_inflight(boundary, now)
            if max(older_load, newer_load) >= LOAD_FLOOR and not older_load / SHIFT < newer_load < older_load * SHIFT:
                return True
        older = [(self.prompt_tokens(p, exact), o, slo) for when, p, o, slo, exact in self._arrived if start <= when < boundary]
        newer = [(self.prompt_tokens(p, exact), o, slo) for when, p, o, slo, exact in self._arrived if when >= boundary]
        if not older or not newer:
            return False
        if most_asked(slo for _, _, slo in newer) != most_asked(slo for _, _, slo in older):
            return True
        for i in (0, 1):
            ratio = statistics.median(a[i] for a in newer) / statistics.median(a[i] for a in older)
            if ratio >= SHIFT or ratio <= 1 / SHIFT:
                return True
        return False

    def _mean_inflight(self, start: float, now: float) -> float:
        """The time-weighted mean of the requests in flight from ``start`` to ``now``."""
        area, level, at = 0.0, 0, start
        for when, inflight in self._changes:
            if when > at:
                area += level * (when - at)
                at = when
            level = inflight
        area += level * (now - at)
        return area / (now - start)
