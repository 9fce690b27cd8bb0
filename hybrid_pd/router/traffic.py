"""What the router measures of the live traffic for the planner: lengths, load and arrival rate over a sliding window.

The lengths are those of the requests that *arrived* in the window, so the planner sees a new
traffic as it comes in, not once its slow requests are done (a 16000-token document under the
wrong layout takes seconds to finish). At arrival the router knows only the client's text and
``max_tokens``; each request's usage, when its answer is done, says what the workers counted,
and the ratios of counted to estimated (the first answer's, then a moving average) scale the estimates of the arrivals.
The load is the time-weighted mean of the requests in flight over the window, what ``vllm
bench serve --max-concurrency`` holds fixed and the simulator's closed loop reproduces.
O(1) per request; the summary walks the window. Times are ``time.perf_counter()``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybrid_pd.sizing.planner import Traffic, traffic_of

__all__ = ["TrafficWindow"]

# Weight of one request's counted/estimated ratio in the moving average: about the last 20 count.
_RATIO_WEIGHT = 0.05


@dataclass
class TrafficWindow:
    """The last ``seconds`` of traffic: the requests that arrived (their estimated lengths) and the requests in flight over time."""

    seconds: float
    prompt_ratio: float = 1.0  # prompt tokens counted / estimated from the text
    output_ratio: float = 1.0  # completion tokens counted / max_tokens asked
    _arrived: deque[tuple[float, int, int]] = field(default_factory=deque)  # (when, estimated prompt tokens, max_tokens)
    _changes: deque[tuple[float, int]] = field(default_factory=deque)  # (when, requests in flight from then on)
    _inflight: int = 0
    _counted: bool = False  # an answer's usage has set the ratios

    def started(self, now: float, prompt_estimate: int, max_tokens: int) -> None:
        self._inflight += 1
        self._changes.append((now, self._inflight))
        self._arrived.append((now, max(1, prompt_estimate), max(1, max_tokens)))

    def ended(self, now: float, prompt_estimate: int, max_tokens: int, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """A request left; its usage, when it told the tokens (a failed or refused one tells nothing), corrects the estimates."""
        self._inflight -= 1
        self._changes.append((now, self._inflight))
        if prompt_tokens and completion_tokens:
            weight = _RATIO_WEIGHT if self._counted else 1.0
            self.prompt_ratio += weight * (prompt_tokens / max(1, prompt_estimate) - self.prompt_ratio)
            self.output_ratio += weight * (completion_tokens / max(1, max_tokens) - self.output_ratio)
            self._counted = True

    def summary(self, now: float) -> Traffic | None:
        """The window's traffic (lengths as 10th-90th percentiles of the arrivals, corrected); None before any arrival in it."""
        since = now - self.seconds
        while self._arrived and self._arrived[0][0] < since:
            self._arrived.popleft()
        while len(self._changes) > 1 and self._changes[1][0] <= since:  # the change in force at ``since`` stays
            self._changes.popleft()
        area, level, at = 0.0, 0, since
        for when, inflight in self._changes:
            if when > at:
                area += level * (when - at)
                at = when
            level = inflight
        area += level * (now - at)
        # A router whose traffic began inside the window has seen only part of it: over the whole window, 128 requests in
        # flight for 2 s would read as 25 (the GPU run: the planner moved only once the window had filled).
        covered = min(self.seconds, now - self._changes[0][0]) if self._changes else self.seconds
        arrived = [(round(p * self.prompt_ratio), round(o * self.output_ratio)) for _, p, o in self._arrived]
        return traffic_of(arrived, area / covered, covered) if covered > 0 else None
