"""The planner simulated: flexible workers whose roles the planner gives, under traffic that changes phase.

The same brain as the router's (:mod:`hybrid_pd.sizing.planner`): every ``period_s`` of simulated
time it measures what a router would, with the router's own measure fed the simulated arrivals and
answers (:class:`~hybrid_pd.sizing.traffic.TrafficWindow`), decides (:func:`~hybrid_pd.sizing.planner.decide`)
and gives the workers their roles (:func:`~hybrid_pd.sizing.planner.assign`). Requests already
routed finish where they are, as on the router. So the planner's logic is tested in seconds on a
CPU, against the fixed layouts under the same traffic, before any GPU run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hybrid_pd.sizing.layouts import Layout, layouts
from hybrid_pd.sizing.planner import Decision, assign, decide
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.simulate import SLO, Outcome, Prediction, Tick, simulate_fixed, simulate_flex, summarize
from hybrid_pd.sizing.traffic import TrafficWindow
from hybrid_pd.sizing.workload import Workload

__all__ = ["Change", "PlannedRun", "compare", "simulate_planner"]


@dataclass(frozen=True)
class Change:
    """A move the planner made, at ``at_s`` of the run."""

    at_s: float
    layout: str
    why: str


@dataclass
class PlannedRun:
    """The outcomes of a planned run and the planner's moves."""

    outcomes: list[Outcome]
    changes: list[Change] = field(default_factory=list)


def simulate_planner(
    profile: Profile, workers: int, phases: Sequence[Workload], slo: SLO, period_s: float, window_s: float, margin: float
) -> PlannedRun:
    """``workers`` flexible workers under ``phases`` (closed loop, one after the other), their roles given by the planner."""
    run = PlannedRun([])
    layout = Layout("flex", 0, workers)
    window = TrafficWindow(window_s, period_s)  # the router's own measure, fed the simulated arrivals and answers
    started: set[int] = set()
    done = 0  # outcomes already told to the window

    def look(now_ms: float, sim: Any) -> tuple[list[int], list[int]] | None:
        nonlocal layout, done
        events = [(r.sent_ms, 1, r.request) for r in sim.routes.values() if r.request.id not in started]
        events += [(o.sent_ms, 1, o.request) for o in sim.outcomes[done:] if o.request.id not in started]
        events += [(o.done_ms, 0, o.request) for o in sim.outcomes[done:]]
        done = len(sim.outcomes)
        for at_ms, arrival, r in sorted(events, key=lambda e: (e[0], e[1])):
            if arrival:
                started.add(r.id)
                window.started(at_ms / 1e3, r.prompt, r.output, r.slo or slo)  # as the router resolves a request's x-slo-* headers
            else:
                window.ended(at_ms / 1e3, r.prompt, r.output, r.prompt, r.output)
        traffic = window.summary(now_ms / 1e3)
        if traffic is None or traffic.requests < 2 * workers:
            return None
        decision: Decision = decide(profile, traffic, slo, workers, layout, margin)
        sim.split_prompts = decision.split_prompts
        if not decision.moves:
            return None
        layout = decision.layout
        run.changes.append(Change(now_ms / 1e3, layout.name, decision.why))
        ids = [str(i) for i in range(workers)]
        now_roles = {str(i): ("prefill" if i in sim.prefillers else "decode" if sim.split else "whole") for i in range(workers)}
        decodes = {str(i): sum(1 for r in sim.routes.values() if r.decode == i) for i in range(workers)}
        roles = assign(layout, ids, now_roles, decodes)
        return [i for i in range(workers) if roles[str(i)] == "prefill"], [i for i in range(workers) if roles[str(i)] != "prefill"]

    run.outcomes = simulate_flex(profile, workers, phases, Tick(period_s * 1e3, look))
    return run


def compare(
    profile: Profile, workers: int, phases: Sequence[Workload], slo: SLO, period_s: float, window_s: float, margin: float
) -> tuple[PlannedRun, list[Prediction], list[list[Prediction]]]:
    """The planner's run; its figures first (layout ``planner``), then every fixed layout's of ``workers`` GPUs under the same
    phases: over the whole run, and of each phase (in the same order), as the GPU runner's phase table gives them."""
    run = simulate_planner(profile, workers, phases, slo, period_s, window_s, margin)
    served = [(Layout("flex", 0, workers), run.outcomes)]
    served += [(layout, simulate_fixed(profile, layout, phases)) for layout in layouts(workers) if layout.kind != "flex"]

    def figures(outcomes_of: Callable[[list[Outcome]], list[Outcome]]) -> list[Prediction]:
        rows = [summarize(layout, outcomes_of(outcomes), slo) for layout, outcomes in served]
        return [replace(rows[0], layout="planner", kind="planner"), *rows[1:]]

    ends = list(itertools.accumulate(phase.num_prompts for phase in phases))  # request ids run on across phases
    each = [figures(lambda outcomes, lo=end - phase.num_prompts, hi=end: [o for o in outcomes if lo <= o.request.id < hi])
            for phase, end in zip(phases, ends, strict=True)]  # fmt: skip
    return run, figures(lambda outcomes: outcomes), each
