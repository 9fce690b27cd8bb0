"""From one target's requests at one load level to the numbers a report shows.

- Percentiles interpolate linearly between order statistics (numpy's default), so
  p50 of [1, 2, 3, 4] is 2.5.
- Latency distributions count successful requests only; TTFT, TPOT and end-to-end
  latency are one value per request, ITL one value per gap between token events
  (pooled over all requests, as vLLM's ``benchmark_serving`` does).
- Throughputs divide by the level's wall time (first request sent to last one done,
  failures included), so they are what the server sustained at that load.
- Goodput (DistServe's definition, vLLM's ``--goodput``): successful requests per second
  whose TTFT and mean inter-token latency (TPOT) are both within the SLOs; an SLO that is
  not given is always met. A request with a single output token has no TPOT and meets
  the ITL SLO.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_pd.bench.client import RequestResult

__all__ = ["SLO", "Distribution", "Summary", "percentile", "summarize"]

PERCENTILES = (50, 90, 99)
_SHOWN_ERRORS = 5


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated; NaN when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Count, mean and p50/p90/p99 of a latency, in seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution | None:
        """The distribution of ``values``; None when there are none."""
        data = list(values)
        if not data:
            return None
        return cls(len(data), sum(data) / len(data), *(percentile(data, q) for q in PERCENTILES))

    def to_json_ms(self) -> dict[str, float]:
        """Milliseconds, rounded to the microsecond."""
        return {
            "count": self.count,
            **{k: round(getattr(self, k) * 1e3, 3) for k in ("mean", "p50", "p90", "p99")},
        }


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; None: no objective on that latency."""

    ttft_s: float | None = None
    itl_s: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None

    def met(self, result: RequestResult) -> bool:
        """Whether a request succeeded within both objectives (TTFT, and mean ITL = TPOT)."""
        if not result.ok:
            return False
        if self.ttft_s is not None and (result.ttft_s is None or result.ttft_s > self.ttft_s):
            return False
        tpot = result.tpot_s
        return self.itl_s is None or tpot is None or tpot <= self.itl_s

    def to_json_ms(self) -> dict[str, float | None]:
        return {
            "ttft_ms": None if self.ttft_s is None else self.ttft_s * 1e3,
            "itl_ms": None if self.itl_s is None else self.itl_s * 1e3,
        }


@dataclass(frozen=True)
class Summary:
    """One target at one load level."""

    requests: int
    completed: int
    errors: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    length_mismatches: int  # completed requests whose output length is not the one asked for
    usage_missing: int  # completed requests whose stream had no usage (tokens counted from events)
    ttft: Distribution | None
    itl: Distribution | None
    tpot: Distribution | None
    e2e: Distribution | None
    slo_met: int | None  # None without SLOs
    error_samples: tuple[tuple[str, int], ...]  # the most common errors and how often each happened

    @property
    def request_throughput(self) -> float:
        """Completed requests per second."""
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        """Output tokens of completed requests per second."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def goodput(self) -> float | None:
        """Requests per second that met every SLO; None without SLOs."""
        if self.slo_met is None:
            return None
        return self.slo_met / self.duration_s if self.duration_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        def dist(d: Distribution | None) -> dict[str, float] | None:
            return None if d is None else d.to_json_ms()

        return {
            "requests": self.requests,
            "completed": self.completed,
            "errors": self.errors,
            "duration_s": round(self.duration_s, 6),
            "request_throughput": round(self.request_throughput, 4),
            "output_throughput": round(self.output_throughput, 3),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "length_mismatches": self.length_mismatches,
            "usage_missing": self.usage_missing,
            "ttft_ms": dist(self.ttft),
            "itl_ms": dist(self.itl),
            "tpot_ms": dist(self.tpot),
            "e2e_ms": dist(self.e2e),
            "slo_met": self.slo_met,
            "goodput": None if self.goodput is None else round(self.goodput, 4),
            "error_samples": [{"error": e, "count": n} for e, n in self.error_samples],
        }


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slo: SLO | None = None,
    input_len: int | None = None,
    output_len: int | None = None,
) -> Summary:
    """Summarize one target's ``results`` over ``duration_s`` seconds of wall time.

    ``input_len`` stands in for the prompt tokens of a request whose usage did not say;
    ``output_len`` is the length every request asked for (to count mismatches).
    """
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    slo = slo or SLO()
    prompt_tokens = [r.prompt_tokens if r.prompt_tokens is not None else (input_len or 0) for r in done]
    return Summary(
        requests=len(results),
        completed=len(done),
        errors=len(failed),
        duration_s=duration_s,
        input_tokens=sum(prompt_tokens),
        output_tokens=sum(r.output_tokens for r in done),
        length_mismatches=sum(1 for r in done if output_len is not None and r.output_tokens != output_len),
        usage_missing=sum(1 for r in done if not r.usage_reported),
        ttft=Distribution.of(r.ttft_s for r in done if r.ttft_s is not None),
        itl=Distribution.of(gap for r in done for gap in r.itl_s),
        tpot=Distribution.of(t for r in done if (t := r.tpot_s) is not None),
        e2e=Distribution.of(r.e2e_s for r in done),
        slo_met=sum(1 for r in done if slo.met(r)) if slo.given else None,
        error_samples=tuple(Counter(r.error or "" for r in failed).most_common(_SHOWN_ERRORS)),
    )
