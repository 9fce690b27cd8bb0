"""How a profile's numbers are fitted to measurements, whichever measurements they are.

Two sources fit profiles: the real-scale goodput matrix (:mod:`.matrix`, measured for another
purpose) and ``hybrid-pd profile`` (:mod:`.profiler`, one server measured for this). They
measure different things but fit each quantity the same way, here:

- **decode step**: step time against decoding rows and their context, least squares with
  coefficients >= 0 (:func:`fit_decode_step`);
- **prompt latency**: a lone prompt's TTFT less what the engine spends on it
  (:func:`prompt_latency_residue`); what is left holds no GPU;
- **prefill per token**: the cost that makes the simulator serve a prefill-bound run at the
  throughput it was measured at (:func:`match_throughput`), since the lone TTFTs alone cannot tell
  GPU time from the latency that holds none;
- **transfer**: ``latency + bytes / bandwidth`` against the bytes of each transfer (:func:`fit_transfer`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence

from hybrid_pd.sizing.layouts import Layout
from hybrid_pd.sizing.profile import DecodeStep, Profile, Transfer
from hybrid_pd.sizing.simulate import SLO, predict
from hybrid_pd.sizing.workload import Workload

__all__ = [
    "bisect_root",
    "engine_prefill_ms",
    "fit_decode_step",
    "fit_transfer",
    "match_throughput",
    "nonnegative_least_squares",
    "prompt_latency_residue",
]


def fit_decode_step(points: Sequence[tuple[float, float, float]]) -> DecodeStep:
    """``(rows, context tokens per row, step ms)`` points -> ``base + per_seq x rows + per_context_token x rows x context``."""
    base, per_seq, per_token = nonnegative_least_squares([([1.0, rows, rows * context], ms) for rows, context, ms in points])
    return DecodeStep(base_ms=base, per_seq_ms=per_seq, per_context_token_ms=per_token)


def engine_prefill_ms(profile: Profile, tokens: int) -> float:
    """What a lone prompt of ``tokens`` costs the engine: its prefill steps, chunked at the token budget, as the simulator runs them."""
    budget = profile.max_num_batched_tokens
    full, rest = divmod(tokens, budget)
    return full * profile.step_ms(0, 0, budget, 1) + (profile.step_ms(0, 0, rest, 1) if rest else 0.0)


def prompt_latency_residue(profile: Profile, lone_ttft_ms: Mapping[int, Sequence[float]]) -> list[tuple[int, float]]:
    """The prompt latency table: per prompt length, the mean lone TTFT less the engine's prefill of it (>= 0)."""
    return [(n, max(statistics.mean(ttft - engine_prefill_ms(profile, n) for ttft in v), 0.0)) for n, v in sorted(lone_ttft_ms.items())]


def match_throughput(make: Callable[[float], Profile], layout: Layout, workload: Workload, measured_rps: float, high: float) -> Profile:
    """``make(per_token)`` at the prefill cost in ``[0, high]`` ms/token whose simulated throughput of ``workload`` is ``measured_rps``.

    The simulated throughput falls as the cost rises; a measured throughput above the one at no
    cost gives 0, below the one at ``high`` gives ``high``.
    """
    unbounded = SLO(math.inf, math.inf)
    return make(bisect_root(lambda p: measured_rps - predict(make(p), layout, workload, unbounded).throughput_rps, 0.0, high))


def fit_transfer(points: Sequence[tuple[float, float]]) -> Transfer:
    """``(bytes, ms)`` of transfers -> ``latency_ms + bytes / bandwidth``; needs two sizes at least, and time growing with bytes."""
    if len({b for b, _ in points}) < 2:
        raise ValueError("a transfer fit needs transfers of two sizes at least")
    latency, ms_per_mb = nonnegative_least_squares([([1.0, b / 1e6], ms) for b, ms in points])
    if ms_per_mb <= 0:
        raise ValueError("the measured transfer time does not grow with its bytes: no bandwidth to fit")
    return Transfer(latency_ms=latency, bandwidth_gbps=1.0 / ms_per_mb)


def nonnegative_least_squares(points: list[tuple[list[float], float]]) -> list[float]:
    """Least squares with every coefficient >= 0: the most negative one is held at 0 and the rest refitted, until none is."""
    free = list(range(len(points[0][0])))
    while True:
        coef = _least_squares([([x[i] for i in free], y) for x, y in points])
        if all(c >= 0 for c in coef):
            out = [0.0] * len(points[0][0])
            for i, c in zip(free, coef, strict=True):
                out[i] = c
            return out
        free.pop(min(range(len(coef)), key=coef.__getitem__))


def _least_squares(points: list[tuple[list[float], float]]) -> list[float]:
    """The normal equations, solved by Gauss-Jordan elimination (a few coefficients)."""
    n = len(points[0][0])
    a = [[sum(x[i] * x[j] for x, _ in points) for j in range(n)] + [sum(x[i] * y for x, y in points)] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0:
            raise ValueError("the fit's points do not determine its coefficients")
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def bisect_root(f: Callable[[float], float], low: float, high: float, steps: int = 40) -> float:
    """The root of ``f``, increasing over ``[low, high]``."""
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < 0 else (low, mid)
    return (low + high) / 2
