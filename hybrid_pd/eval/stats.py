"""Confidence intervals for accuracies and for the difference between two endpoints.

- One accuracy: the Wilson score interval, which stays inside [0, 1] and behaves at
  accuracies near 0 or 1 and at small n, where the normal approximation does not.
- A difference of two accuracies on the same questions: a paired normal approximation,
  mean of the per-question differences ± z · sd / sqrt(n). Pairing matters: two
  endpoints that answer alike have a much narrower interval than independent samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Z95", "Interval", "paired_difference", "wilson"]

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile


@dataclass(frozen=True)
class Interval:
    """A point estimate and its confidence interval."""

    value: float
    low: float
    high: float

    def to_json(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


def wilson(successes: int, n: int, z: float = Z95) -> Interval:
    """The proportion ``successes / n`` with its Wilson score interval (0 questions: all zero)."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return Interval(0.0, 0.0, 0.0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends, where rounding would not be
    high = 1.0 if successes == n else min(1.0, centre + half)
    return Interval(p, low, high)


def paired_difference(a: Sequence[bool], b: Sequence[bool], z: float = Z95) -> Interval:
    """Mean of ``a[i] - b[i]`` with a normal-approximation interval (paired samples)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} != {len(b)}")
    n = len(a)
    if n == 0:
        return Interval(0.0, 0.0, 0.0)
    diffs = [int(x) - int(y) for x, y in zip(a, b, strict=True)]
    mean = sum(diffs) / n
    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    half = z * math.sqrt(variance / n)
    return Interval(mean, mean - half, mean + half)
