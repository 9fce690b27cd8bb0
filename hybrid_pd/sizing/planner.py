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

Under a split, a request whose prompt is far from the traffic the layout was sized for is served
whole by any worker (:attr:`Decision.split_prompts`, :func:`split_prompts`). :data:`SHORT` times
shorter than its shortest tenth: its prefill is small, and a split would put its decode on the few
decoders of a layout sized for long prompts (when chat follows long documents, its first requests
arrive under 3P1D, before the planner has seen them; split, all of them decode on the one decoder:
simulated on four H100s, chat -> documents -> chat at 4000/15 ms, the planner 0.92x the replicas'
goodput for this alone). :data:`LONG` times longer than its longest tenth: a split would queue its
prefill on the few prefillers of a layout sized for short prompts (documents after chat under
1P3D: their first wave, 32 prompts of 16000 tokens, on one prefiller; whole, on all four workers:
simulated, the documents' goodput 1.17 -> 1.43 per GPU, 3P1D's own 1.52). Whole is every layout's
neutral ground: no role holds it up. A steady traffic is sized for its 10th-90th percentiles, so
only its outer tails go whole, on any worker (a decoder that takes a long one whole stalls its
decodes for that prefill, as a replica does).

The SLO pair is the one the traffic asked for (:attr:`Traffic.slo`: requests name their targets in
the ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` headers, llm-d's names) where it did, else the
router's. A chat that wants its first token in 500 ms and documents that may wait 4 s are sized
each for its own: under one pair for both, the documents' best layout is judged by a TTFT no layout
reaches (simulated on four H100s, chat -> documents -> chat at 500/20 for all, the planner flipped
3P1D -> whole requests mid-documents on a predicted goodput of 0.09 against 0).

Closed loop: the simulated clients keep the traffic's mean number of requests in flight, as
``vllm bench serve --max-concurrency`` does; the lengths are uniform over the traffic's 10th to
90th percentiles. Predictions are memoized on the traffic rounded to what the simulator can
tell apart (lengths to two significant digits, concurrency to a whole request), so a steady
traffic costs one simulation per layout.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from hybrid_pd.bench.stats import percentile
from hybrid_pd.sizing.layouts import Layout
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.simulate import Prediction, predict
from hybrid_pd.sizing.workload import SLO, Lengths, Workload

__all__ = ["LONG", "ROLES", "SHORT", "Decision", "Role", "Traffic", "assign", "candidates", "decide", "most_asked", "split_prompts", "traffic_of",
           "workload_of"]

# A flexible worker's role: it prefills for the decoders, decodes what the prefillers hand it, or serves whole requests.
Role = Literal["prefill", "decode", "whole"]
ROLES: tuple[str, ...] = get_args(Role)

# Under a split, prompts this many times shorter than the sized traffic's 10th percentile, or longer than its 90th, are served whole.
SHORT = LONG = 2.0
# Seeds each candidate is simulated on: their spread is the noise a move must beat.
SEEDS = (0, 1)
# ... each at this share of the measured requests in flight: near an SLO's edge goodput falls off a cliff with the load,
# and a measured load is itself noisy, so a move must beat what 10% more or less load would change.
LOADS = (0.9, 1.1)
# Requests each simulation sends: five waves of the load, at least this many and at most the upper bound.
MIN_PROMPTS, MAX_PROMPTS = 96, 480


@dataclass(frozen=True)
class Traffic:
    """What the router measured of the traffic over its window: lengths as 10th-90th percentiles, load as mean requests in
    flight, and the SLO pair most of its requests asked for (None: none asked; the router's then)."""

    requests: int  # arrived in the window
    prompt: Lengths
    output: Lengths
    concurrency: float
    rate_rps: float
    slo: SLO | None = None

    def rounded(self) -> Traffic:
        """The traffic as the simulator can tell it apart: lengths to two significant digits, a whole number of requests in flight."""
        r = lambda n: max(1, int(round(n, 2 - len(str(n)))))  # noqa: E731
        prompt, output = Lengths(r(self.prompt.low), r(self.prompt.high)), Lengths(r(self.output.low), r(self.output.high))
        return Traffic(self.requests, prompt, output, float(max(1, round(self.concurrency))), self.rate_rps, self.slo)


def traffic_of(arrived: Sequence[tuple[int, int, SLO | None]], concurrency: float, seconds: float) -> Traffic | None:
    """The traffic of the requests that arrived within ``seconds``, given as (prompt tokens, output tokens, the SLO pair it
    asked for or None); None for none. Of several pairs, the most asked (:func:`most_asked`): a mix is sized for its
    majority, not for targets nobody asked (the median of 500/20 and 4000/15 would be neither)."""
    if not arrived:
        return None

    def lengths(values: list[int]) -> Lengths:
        return Lengths(max(1, round(percentile(values, 10))), max(1, round(percentile(values, 90))))

    prompt, output = lengths([p for p, _, _ in arrived]), lengths([o for _, o, _ in arrived])
    return Traffic(len(arrived), prompt, output, concurrency, len(arrived) / seconds, most_asked(slo for _, _, slo in arrived))


def most_asked(slos: Iterable[SLO | None]) -> SLO | None:
    """The SLO pair most asked of ``slos`` (the first seen of equals; None names none); None when none was."""
    asked = Counter(slo for slo in slos if slo is not None).most_common(1)
    return asked[0][0] if asked else None


@dataclass(frozen=True)
class Decision:
    """The planner's answer: the layout to run (``layout`` is ``current`` when it stays), every candidate's prediction and why."""

    layout: Layout
    current: Layout
    predictions: tuple[Prediction, ...]  # one per candidate, goodput and throughput the mean of the seeds
    noise: float  # the largest relative spread between seeds of the two layouts compared
    why: str
    split_prompts: Lengths | None = None  # prompt tokens a split serves under ``layout``; others whole (:func:`split_prompts`)

    @property
    def moves(self) -> bool:
        return self.layout != self.current


def candidates(workers: int) -> list[Layout]:
    """Every layout of ``workers`` flexible workers of one GPU each: all whole, then 1P(N-1)D ... (N-1)P1D."""
    return [Layout("flex", 0, workers)] + [Layout("pd", x, workers - x) for x in range(1, workers)]


def split_prompts(layout: Layout, traffic: Traffic) -> Lengths | None:
    """The prompt tokens a split serves under ``layout`` sized for ``traffic`` (shorter or longer: whole); None without a split."""
    return Lengths(int(traffic.prompt.low / SHORT), int(traffic.prompt.high * LONG)) if layout.kind == "pd" else None


def workload_of(traffic: Traffic, seed: int) -> Workload:
    """The closed-loop workload the simulator sends for ``traffic``."""
    concurrency = max(1, round(traffic.concurrency))
    prompts = min(MAX_PROMPTS, max(MIN_PROMPTS, 5 * concurrency))
    return Workload(traffic.prompt, traffic.output, prompts, concurrency=concurrency, seed=seed)


def decide(profile: Profile, traffic: Traffic, slo: SLO, workers: int, current: Layout, margin: float) -> Decision:
    """The layout of ``workers`` flexible workers to run for ``traffic``, given the one running now (``current``), sized for
    the SLO pair the traffic asked for, else ``slo``."""
    slo = traffic.slo or slo
    layouts = candidates(workers)
    if current not in layouts:
        raise ValueError(f"{current.name} is not a layout of {workers} flexible workers")
    key = profile.model_dump_json()  # the cache's key: a profile holds lists, which do not hash
    runs = {layout: _predicted(key, traffic.rounded(), slo, layout) for layout in layouts}
    mean = {layout: _mean(preds) for layout, preds in runs.items()}
    by_goodput = any(p.goodput_per_gpu > 0 for p in mean.values())
    score = (lambda p: p.goodput_per_gpu) if by_goodput else (lambda p: p.throughput_rps)  # noqa: E731
    metric = f"goodput per GPU at {slo} ms" if by_goodput else f"throughput (no layout meets {slo} ms)"
    best = max(layouts, key=lambda layout: (score(mean[layout]), layout == current, -layout.prefill))
    predictions = tuple(mean[layout] for layout in layouts)
    if best == current:
        return Decision(current, current, predictions, 0.0, f"{current.name} predicted best by {metric}", split_prompts(current, traffic))
    noise = max(_spread(runs[best], score), _spread(runs[current], score))
    now, then = score(mean[current]), score(mean[best])
    gain = (then - now) / now if now > 0 else math.inf
    if gain <= margin or gain <= noise:
        why = f"stay on {current.name}: {best.name} predicted {gain:+.0%} {metric}, within the margin ({margin:.0%}) or the noise ({noise:.0%})"
        return Decision(current, current, predictions, noise, why, split_prompts(current, traffic))
    why = f"{current.name} -> {best.name}: predicted {now:.3g} -> {then:.3g} {metric} ({gain:+.0%}; noise {noise:.0%})"
    return Decision(best, current, predictions, noise, why, split_prompts(best, traffic))


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
