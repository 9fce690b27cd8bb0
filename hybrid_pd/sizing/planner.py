"""The planner's decision: which layout of N flexible workers serves the live traffic best, and whether to move to it.

A pure function over typed inputs (:func:`decide`): what the router measured of the traffic
(:class:`Traffic`), the model's profile, the SLO pair, the workers and the layout they run now.
Every candidate layout of ``workers`` flexible workers (all serving whole requests, or any xPyD
split) is simulated under a workload with the traffic's lengths and load (the simulator
``hybrid-pd size`` runs, so one model sizes offline and steers live), on two seeds, at 0.9x and
1.1x the measured load. The best is
the one with the most goodput per GPU (then throughput; equals keep the layout in place, then
the one that splits least). The planner moves only when the gain is larger than the noise:
above ``margin`` of the current layout's goodput and above the spread between the two runs of
either layout (near an SLO's edge, what 10% more or less load changes). Where no layout meets the SLOs at all (goodput 0 everywhere) throughput decides,
with the same margin.

Under a split, a request whose prompt is :data:`SHORT` times shorter than the shortest tenth of the
traffic the layout was sized for is served whole by any worker (:attr:`Decision.whole_below`):
its prefill is small, and a split would put its decode on the few decoders of a layout sized for
long prompts. When chat follows long documents, its first requests arrive under 3P1D, before the
planner has seen them; split, all of them decode on the one decoder (simulated on four H100s:
chat -> documents -> chat at 4000/15 ms, the planner 0.92x the replicas' goodput for this alone).

Closed loop: the simulated clients keep the traffic's mean number of requests in flight, as
``vllm bench serve --max-concurrency`` does; the lengths are uniform over the traffic's 10th to
90th percentiles. Predictions are memoized on the traffic rounded to what the simulator can
tell apart (lengths to two significant digits, concurrency to a whole request), so a steady
traffic costs one simulation per layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from hybrid_pd.bench.stats import percentile
from hybrid_pd.sizing.layouts import Layout
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.simulate import SLO, Prediction, predict
from hybrid_pd.sizing.workload import Lengths, Workload

__all__ = ["ROLES", "SHORT", "Decision", "Role", "Traffic", "assign", "candidates", "decide", "traffic_of", "whole_below", "workload_of"]

# A flexible worker's role: it prefills for the decoders, decodes what the prefillers hand it, or serves whole requests.
Role = Literal["prefill", "decode", "whole"]
ROLES: tuple[str, ...] = get_args(Role)

# Under a split, prompts this many times shorter than the sized traffic's 10th percentile are served whole.
SHORT = 2.0
# Seeds each candidate is simulated on: their spread is the noise a move must beat.
SEEDS = (0, 1)
# ... each at this share of the measured requests in flight: near an SLO's edge goodput falls off a cliff with the load,
# and a measured load is itself noisy, so a move must beat what 10% more or less load would change.
LOADS = (0.9, 1.1)
# Requests each simulation sends: five waves of the load, at least this many and at most the upper bound.
MIN_PROMPTS, MAX_PROMPTS = 96, 480


@dataclass(frozen=True)
class Traffic:
    """What the router measured of the traffic over its window: lengths as 10th-90th percentiles, load as mean requests in flight."""

    requests: int  # arrived in the window
    prompt: Lengths
    output: Lengths
    concurrency: float
    rate_rps: float

    def rounded(self) -> Traffic:
        """The traffic as the simulator can tell it apart: lengths to two significant digits, a whole number of requests in flight."""
        r = lambda n: max(1, int(round(n, 2 - len(str(n)))))  # noqa: E731
        prompt, output = Lengths(r(self.prompt.low), r(self.prompt.high)), Lengths(r(self.output.low), r(self.output.high))
        return Traffic(self.requests, prompt, output, float(max(1, round(self.concurrency))), self.rate_rps)


def traffic_of(arrived: Sequence[tuple[int, int]], concurrency: float, seconds: float) -> Traffic | None:
    """The traffic of the requests that arrived within ``seconds``, given as (prompt, output) tokens; None for none."""
    if not arrived:
        return None

    def lengths(values: list[int]) -> Lengths:
        return Lengths(max(1, round(percentile(values, 10))), max(1, round(percentile(values, 90))))

    return Traffic(len(arrived), lengths([p for p, _ in arrived]), lengths([o for _, o in arrived]), concurrency, len(arrived) / seconds)


@dataclass(frozen=True)
class Decision:
    """The planner's answer: the layout to run (``layout`` is ``current`` when it stays), every candidate's prediction and why."""

    layout: Layout
    current: Layout
    predictions: tuple[Prediction, ...]  # one per candidate, goodput and throughput the mean of the seeds
    noise: float  # the largest relative spread between seeds of the two layouts compared
    why: str
    whole_below: int = 0  # prompt tokens: shorter requests are served whole under ``layout`` (:func:`whole_below`)

    @property
    def moves(self) -> bool:
        return self.layout != self.current


def candidates(workers: int) -> list[Layout]:
    """Every layout of ``workers`` flexible workers of one GPU each: all whole, then 1P(N-1)D ... (N-1)P1D."""
    return [Layout("flex", 0, workers)] + [Layout("pd", x, workers - x) for x in range(1, workers)]


def whole_below(layout: Layout, traffic: Traffic) -> int:
    """The prompt tokens below which a request is served whole under ``layout``, sized for ``traffic``: 0 without a split."""
    return int(traffic.prompt.low / SHORT) if layout.kind == "pd" else 0


def workload_of(traffic: Traffic, seed: int) -> Workload:
    """The closed-loop workload the simulator sends for ``traffic``."""
    concurrency = max(1, round(traffic.concurrency))
    prompts = min(MAX_PROMPTS, max(MIN_PROMPTS, 5 * concurrency))
    return Workload(traffic.prompt, traffic.output, prompts, concurrency=concurrency, seed=seed)


def decide(profile: Profile, traffic: Traffic, slo: SLO, workers: int, current: Layout, margin: float) -> Decision:
    """The layout of ``workers`` flexible workers to run for ``traffic``, given the one running now (``current``)."""
    layouts = candidates(workers)
    if current not in layouts:
        raise ValueError(f"{current.name} is not a layout of {workers} flexible workers")
    key = profile.model_dump_json()  # the cache's key: a profile holds lists, which do not hash
    runs = {layout: _predicted(key, traffic.rounded(), slo, layout) for layout in layouts}
    mean = {layout: _mean(preds) for layout, preds in runs.items()}
    by_goodput = any(p.goodput_per_gpu > 0 for p in mean.values())
    score = (lambda p: p.goodput_per_gpu) if by_goodput else (lambda p: p.throughput_rps)  # noqa: E731
    metric = "goodput per GPU" if by_goodput else "throughput (no layout meets the SLOs)"
    best = max(layouts, key=lambda layout: (score(mean[layout]), layout == current, -layout.prefill))
    predictions = tuple(mean[layout] for layout in layouts)
    if best == current:
        return Decision(current, current, predictions, 0.0, f"{current.name} predicted best by {metric}", whole_below(current, traffic))
    noise = max(_spread(runs[best], score), _spread(runs[current], score))
    now, then = score(mean[current]), score(mean[best])
    gain = (then - now) / now if now > 0 else math.inf
    if gain <= margin or gain <= noise:
        why = f"stay on {current.name}: {best.name} predicted {gain:+.0%} {metric}, within the margin ({margin:.0%}) or the noise ({noise:.0%})"
        return Decision(current, current, predictions, noise, why, whole_below(current, traffic))
    why = f"{current.name} -> {best.name}: predicted {now:.3g} -> {then:.3g} {metric} ({gain:+.0%}; noise {noise:.0%})"
    return Decision(best, current, predictions, noise, why, whole_below(best, traffic))


def _spread(runs: Sequence[Prediction], score) -> float:  # noqa: ANN001 - the score of decide
    """The relative spread of a layout's score between seeds (0 when it is 0 on every seed)."""
    values = [score(p) for p in runs]
    top = max(values)
    return (top - min(values)) / top if top > 0 else 0.0


def _mean(runs: Sequence[Prediction]) -> Prediction:
    """One prediction of a layout: the first seed's, with goodput and throughput the mean over the seeds."""
    n = len(runs)
    return replace(
        runs[0],
        throughput_rps=sum(p.throughput_rps for p in runs) / n,
        goodput_rps=sum(p.goodput_rps for p in runs) / n,
        goodput_per_gpu=sum(p.goodput_per_gpu for p in runs) / n,
        slo_met=sum(p.slo_met for p in runs) / n,
    )


@functools.lru_cache(maxsize=512)
def _predicted(profile: str, traffic: Traffic, slo: SLO, layout: Layout) -> tuple[Prediction, ...]:
    """``layout``'s prediction for the (rounded) ``traffic`` on each seed, memoized: a steady traffic is simulated once."""
    return tuple(predict(_profile(profile), layout, workload_of(replace(traffic, concurrency=traffic.concurrency * load), seed), slo)
                 for seed, load in zip(SEEDS, LOADS, strict=True))  # fmt: skip


@functools.lru_cache(maxsize=8)
def _profile(text: str) -> Profile:
    return Profile.model_validate_json(text)


def assign(layout: Layout, workers: Sequence[str], now: Mapping[str, Role], decodes: Mapping[str, int]) -> dict[str, Role]:
    """Each of ``workers`` (ids, in order) given its role in ``layout``, moving as few as it can.

    Workers that prefill now keep prefilling while the layout has room for them (the first in
    order); more prefillers come from the workers with the fewest ``decodes`` in flight, which
    go on decoding what they hold while they take prefills. Every other worker decodes; with no
    split, every worker serves whole requests.
    """
    if layout.kind != "pd":
        return {w: "whole" for w in workers}
    if layout.prefill + layout.decode != len(workers):
        raise ValueError(f"{layout.name} is not a layout of {len(workers)} workers")
    keep = [w for w in workers if now.get(w) == "prefill"][: layout.prefill]
    rest = sorted((w for w in workers if w not in keep), key=lambda w: (decodes.get(w, 0), workers.index(w)))
    prefill = set(keep + rest[: layout.prefill - len(keep)])
    return {w: "prefill" if w in prefill else "decode" for w in workers}
