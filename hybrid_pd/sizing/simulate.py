"""The discrete-event simulation of a layout serving a workload, and what a benchmark would report of it.

The client is ``vllm bench serve``'s: closed loop (``--max-concurrency``: the first requests
at time 0, each next one when one finishes) or Poisson arrivals. The router is hybrid-pd's with
its default policy, least outstanding (fewest legs in flight, then fewest prompt tokens in
flight, then the first worker):

- replicas and flexible workers: each request goes whole to one worker;
- xPyD: the decode worker is picked when the request arrives and counts it from then on
  (the router's lease, prefill leg included), then a prefill worker by its prefill legs in flight. The prefill leg computes the prompt up to token
  N-1 and holds its state; ``handoff_ms`` later the decode leg reaches the decode worker, which
  reserves memory, pulls the state (:meth:`Profile.transfer_ms`; the prefill worker's memory is
  freed when the pull ends) and computes token N as its first step.

A prompt reaches its worker's queue :meth:`Profile.prompt_latency_ms_at` after it is sent. Each
worker is an :class:`~hybrid_pd.sizing.engine.Engine`. Times are milliseconds; everything is
deterministic for a workload's seed.

Multi-turn traffic (:class:`~hybrid_pd.sizing.workload.Workload` with turns) is routed as the
router's ``prefix_reuse`` policy routes it: a conversation's later turns go to the workers that
served its earlier ones, unless such a worker has more than ``prefix_load_slack`` more legs in flight
than the least loaded one (then the least loaded, which holds nothing of it). A worker that served
the turn before resumes from its prefix cache, up to the last block boundary of what it computed
of that turn (vLLM's hits land on whole blocks, :func:`reusable`): the whole prompt and answer on
a replica or decode worker (vLLM 0.26's Mamba cache mode ``all`` on GPU keeps a state per block,
decode steps included, as measured: replicas' hits ran past the earlier prompt), the prompt's
first N-1 tokens on a prefill worker. Its prompt computes only the rest; a decode leg pulls only
the blocks its cache lacks and the state (``hybrid-pd plan --decode-cached-tokens``). Not
simulated: eviction from the prefix cache (it is taken to hold every conversation in flight) and
a shared system prompt. Salted traffic (``Workload.salted``) reuses nothing and is routed by load.

Workers of a layout run the profile of their tensor-parallel size (:func:`~hybrid_pd.sizing.profile.profile_set`):
the prefill worker's for the prefill leg and the prompt's way to it, the decode worker's for the
rest. A pull between workers of different sizes moves the bytes ``hybrid-pd plan --prefill-tp
--decode-tp`` counts for them (every decode rank's reads together) at the decode worker's measured
transfer rate: the decode ranks read, and a pull across sizes has no rate of its own measured.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from hybrid_pd.bench.stats import percentile
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.sizing.engine import Engine, Job, Step
from hybrid_pd.sizing.layouts import Layout, layouts
from hybrid_pd.sizing.profile import Profile, Profiles
from hybrid_pd.sizing.workload import SLO, Lengths, Request, Workload

__all__ = ["SLO", "Outcome", "Prediction", "Tick", "check_fits", "predict", "predict_many", "simulate", "simulate_fixed", "simulate_flex", "size", "summarize"]


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it."""

    request: Request
    sent_ms: float
    first_ms: float
    done_ms: float

    @property
    def ttft_ms(self) -> float:
        return self.first_ms - self.sent_ms

    @property
    def tpot_ms(self) -> float:
        """vLLM's: the time after the first token over the tokens after it (0 for one token)."""
        return (self.done_ms - self.first_ms) / (self.request.output - 1) if self.request.output > 1 else 0.0


@dataclass(frozen=True)
class Prediction:
    """What ``vllm bench serve`` would report of one layout, goodput as its ``--goodput`` counts it."""

    layout: str
    kind: str
    prefill: int
    decode: int
    gpus: int
    completed: int
    duration_s: float
    throughput_rps: float
    goodput_rps: float
    goodput_per_gpu: float
    slo_met: float  # share of the requests within both targets
    ttft_p50_ms: float
    ttft_mean_ms: float
    tpot_p50_ms: float
    tpot_mean_ms: float
    prefill_tp: int = 1  # GPUs of a prefill worker
    decode_tp: int = 1  # GPUs of a worker that decodes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(layout: Layout, outcomes: list[Outcome], slo: SLO) -> Prediction:
    """The benchmark's figures: the duration runs from the first request sent to the last one done; a request is good within
    the targets it asked for (:attr:`Request.slo`, a phase's), else within ``slo``."""
    duration_s = (max(o.done_ms for o in outcomes) - min(o.sent_ms for o in outcomes)) / 1e3
    good = sum(1 for o in outcomes if o.ttft_ms <= (o.request.slo or slo).ttft_ms and o.tpot_ms <= (o.request.slo or slo).tpot_ms)
    ttft, tpot = [o.ttft_ms for o in outcomes], [o.tpot_ms for o in outcomes]
    return Prediction(
        layout=layout.name,
        kind=layout.kind,
        prefill=layout.prefill,
        decode=layout.decode,
        gpus=layout.gpus,
        prefill_tp=layout.prefill_tp,
        decode_tp=layout.decode_tp,
        completed=len(outcomes),
        duration_s=duration_s,
        throughput_rps=len(outcomes) / duration_s,
        goodput_rps=good / duration_s,
        goodput_per_gpu=good / duration_s / layout.gpus,
        slo_met=good / len(outcomes),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_mean_ms=sum(ttft) / len(ttft),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_mean_ms=sum(tpot) / len(tpot),
    )


def predict(profile: Profile | Profiles, layout: Layout, workload: Workload, slo: SLO) -> Prediction:
    return summarize(layout, simulate(profile, layout, workload), slo)


def size(profile: Profile | Profiles, workload: Workload, slo: SLO, gpu_counts: list[int], jobs: int = 1) -> list[Prediction]:
    """Every layout of each GPU count (:func:`~hybrid_pd.sizing.layouts.layouts`) with workers of the profiles' sizes, under the same traffic."""
    sizes = _by_tp(profile)
    tasks = [(layout, workload) for gpus in gpu_counts for layout in layouts(gpus, sizes)]
    return [per_slo[0] for per_slo in predict_many(sizes, tasks, [slo], jobs)]


def _by_tp(profile: Profile | Profiles) -> Profiles:
    return {profile.tensor_parallel_size: profile} if isinstance(profile, Profile) else profile


def predict_many(profile: Profile | Profiles, tasks: list[tuple[Layout, Workload]], slos: list[SLO], jobs: int = 1) -> list[list[Prediction]]:
    """Each (layout, workload) simulated once and summarized for every SLO pair, in ``jobs`` processes (each simulation is independent)."""
    if jobs <= 1 or len(tasks) <= 1:
        return [_predict_slos((profile, layout, workload, slos)) for layout, workload in tasks]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_predict_slos, [(profile, layout, workload, slos) for layout, workload in tasks]))


def _predict_slos(task: tuple[Profile, Layout, Workload, list[SLO]]) -> list[Prediction]:
    profile, layout, workload, slos = task
    outcomes = simulate(profile, layout, workload)
    return [summarize(layout, outcomes, slo) for slo in slos]


def check_fits(profile: Profile, workload: Workload) -> None:
    """Raise ValueError when the workload's longest request needs more KV cache than a worker has: it would wait forever."""
    longest = workload.longest_request
    if profile.memory_bytes(longest) > profile.cache_bytes:
        raise ValueError(
            f"a request of {longest} tokens needs {profile.memory_bytes(longest):,} bytes of KV cache; the profile's workers have {profile.cache_bytes:,}"
        )


def simulate(profile: Profile | Profiles, layout: Layout, workload: Workload) -> list[Outcome]:
    """Every request of ``workload`` served by ``layout``, its workers each with the profile of its size, in the order
    they were sent (:func:`check_fits` first); ValueError where a size has no profile."""
    sizes = _by_tp(profile)
    if missing := sorted(layout.tp_sizes - set(sizes)):
        raise ValueError(f"{layout.name} has workers of tensor_parallel_size {missing}, and no profile of that size")
    for tp in sorted(layout.tp_sizes):
        check_fits(sizes[tp], workload)
    return _Simulation(sizes[layout.prefill_tp] if layout.kind == "pd" else sizes[layout.decode_tp], sizes[layout.decode_tp], layout, workload).run()


@dataclass(frozen=True)
class Tick:
    """A planner that looks at a running simulation every ``period_ms``.

    ``look(now, simulation)`` reads the simulation (its ``outcomes`` so far, its ``routes`` in
    flight, its ``engines`` and their roles, ``prefillers`` and ``decoders``) and returns the
    workers' new roles as (prefillers, decoders), or None to leave them.
    """

    period_ms: float
    look: Callable[[float, Any], tuple[list[int], list[int]] | None]


def simulate_flex(profile: Profile, workers: int, phases: Sequence[Workload], tick: Tick) -> list[Outcome]:
    """``workers`` flexible workers of one GPU each serving closed-loop ``phases`` one after the other, their roles given by ``tick``
    (all serve whole requests until it says otherwise)."""
    _check_phases(profile, phases)
    return _Simulation(profile, profile, Layout("flex", 0, workers), phases, tick).run()


def simulate_fixed(profile: Profile, layout: Layout, phases: Sequence[Workload]) -> list[Outcome]:
    """``layout`` (workers of one size) serving closed-loop ``phases`` one after the other."""
    _check_phases(profile, phases)
    return _Simulation(profile, profile, layout, phases).run()


def _check_phases(profile: Profile, phases: Sequence[Workload]) -> None:
    for phase in phases:
        check_fits(profile, phase)
        if phase.concurrency is None or phase.turns > 1:
            raise ValueError("phases are closed-loop single requests: give each a concurrency and one turn")


class _Load:
    """The router's view of one worker: legs in flight and their prompt tokens."""

    __slots__ = ("legs", "tokens")

    def __init__(self) -> None:
        self.legs = self.tokens = 0

    def add(self, prompt: int, sign: int) -> None:
        self.legs += sign
        self.tokens += sign * prompt


def _least_outstanding(loads: list[_Load], among: list[int]) -> int:
    return min(among, key=lambda i: (loads[i].legs, loads[i].tokens, i))  # ``among`` in order: the first of equals


# The router's: how many more legs than the least loaded worker the one holding a conversation may have.
PREFIX_LOAD_SLACK = RouterSettings.model_fields["prefix_load_slack"].default


def _pick(loads: list[_Load], among: list[int], home: int | None) -> int:
    """``prefix_reuse`` among the workers ``among``: the one that served the conversation's earlier turn while its load allows, else the least loaded."""
    least = _least_outstanding(loads, among)
    return home if home in among and loads[home].legs <= loads[least].legs + PREFIX_LOAD_SLACK else least


def reusable(earlier: int, tokens: int, block_tokens: int) -> int:
    """Tokens a prefix cache resumes of a prompt computing ``tokens`` whose first ``earlier`` tokens it computed before:
    whole blocks, short of the prompt's last token (vLLM computes at least one)."""
    return min(earlier, tokens - 1) // block_tokens * block_tokens


@dataclass
class _Route:
    """Where the router sent a request: its decode worker and, split, its prefill worker and leg."""

    request: Request
    sent_ms: float
    decode: int
    decode_cached: int = 0  # tokens the decode worker (or replica) resumes from its prefix cache
    prefill: int | None = None
    leg: Job | None = None
    first_ms: float = math.nan


class _Simulation:
    """The event loop over the workers (``engines``, each with the router's view of its load) and the client.

    ``prefillers`` and ``decoders`` are the indices of the workers in each role, in order; none
    prefill for replicas and flexible workers, which serve whole requests. ``tick`` (a period in
    ms and a callback) lets a planner look at the simulation every period and give the roles anew
    (:mod:`hybrid_pd.sizing.planned`): requests already routed finish where they are.
    """

    def __init__(self, prefill: Profile, decode: Profile, layout: Layout, workload: Workload | Sequence[Workload], tick: Tick | None = None) -> None:
        self.prefill_profile, self.decode_profile = prefill, decode
        self.phases = [workload] if isinstance(workload, Workload) else list(workload)
        self.block_tokens = decode.block_tokens  # the roles' agree (profile_set)
        split = layout.prefill if layout.kind == "pd" else 0
        self.engines = [Engine(prefill) for _ in range(split)] + [Engine(decode) for _ in range(layout.decode)]
        self.loads = [_Load() for _ in self.engines]
        self.prefillers, self.decoders = list(range(split)), list(range(split, len(self.engines)))
        self.split_prompts: Lengths | None = None  # under a split, other prompts go whole to any worker (the planner's Decision.split_prompts)
        self.tick = tick
        self.events: list[tuple[float, int, Callable[[float, Any], None], Any]] = []
        self.order = itertools.count()  # ties in time go in the order they were scheduled
        self.planning: set[Engine] = set()
        self.unsent: deque[Request] = deque()
        self.routes: dict[int, _Route] = {}
        self.outcomes: list[Outcome] = []
        self.next_turn: dict[int, Request] = {}  # a turn's id -> the conversation's next turn, sent when it is done
        self.homes: dict[int, tuple[int, int | None]] = {}  # conversation -> (decode worker, prefill worker) of its last turn
        self.later: deque[tuple[int, list[Request]]] = deque()  # closed-loop phases after the one being sent: (concurrency, requests)

    @property
    def split(self) -> bool:
        return bool(self.prefillers)

    def run(self) -> list[Outcome]:
        first, later = self.phases[0], self.phases[1:]  # later phases: closed-loop single requests (_check_phases)
        requests = first.requests()
        expected = len(requests) + sum(w.num_prompts for w in later)
        if first.turns > 1:
            firsts = [r for r in requests if not r.earlier_prompt]
            self.next_turn = {a.id: b for a, b in zip(requests, requests[1:]) if b.earlier_prompt}
            for r in firsts[: first.concurrency]:
                self._at(0.0, self._send, r)
            self.unsent.extend(firsts[first.concurrency :])
        elif first.concurrency is not None:
            offset = 0
            for phase, drawn in zip(self.phases, [requests, *(w.requests() for w in later)]):  # ids run on across phases
                self.later.append((phase.concurrency, [replace(r, id=r.id + offset) for r in drawn]))
                offset += phase.num_prompts
            self._next_phase(0.0)
        else:
            for r in requests:
                self._at(r.sent_s * 1e3, self._send, r)
        if self.tick is not None:
            self._at(self.tick.period_ms, self._ticked, None)
        while self.events and len(self.outcomes) < expected:
            now, _, handler, arg = heapq.heappop(self.events)
            handler(now, arg)
        if len(self.outcomes) != expected:  # a summary of the finished ones would flatter the layout
            raise RuntimeError(f"the simulation stalled with {expected - len(self.outcomes)} of {expected} requests unfinished")
        return sorted(self.outcomes, key=lambda o: (o.sent_ms, o.request.id))

    def _next_phase(self, now: float) -> None:
        """The next closed-loop phase: its first ``concurrency`` requests now, the rest as they finish. Phases run one after
        the other, as ``vllm bench serve`` runs them: the next starts when the last one's requests are all done."""
        concurrency, requests = self.later.popleft()
        self.unsent.extend(requests[concurrency:])
        for r in requests[:concurrency]:
            self._at(now, self._send, r)

    def _at(self, time_ms: float, handler: Callable[[float, Any], None], arg: Any) -> None:
        heapq.heappush(self.events, (time_ms, next(self.order), handler, arg))

    def _ticked(self, now: float, _: None) -> None:
        """The planner looks: it may give the workers new roles (``prefillers``, ``decoders``)."""
        assert self.tick is not None
        roles = self.tick.look(now, self)
        if roles is not None:
            self.prefillers, self.decoders = roles
        self._at(now + self.tick.period_ms, self._ticked, None)

    # --- the client and the router ---

    def _send(self, now: float, r: Request) -> None:
        p, bt = self.decode_profile, self.block_tokens
        bounds = self.split_prompts
        split = self.split and (bounds is None or bounds.low <= r.prompt <= bounds.high)
        arrive = now + (self.prefill_profile if split else p).prompt_latency_ms_at(r.prompt)
        reuses = r.earlier_prompt and not self.phases[0].salted
        home_decode, home_prefill = self.homes.get(r.conversation, (None, None)) if reuses else (None, None)
        among = self.decoders if split else list(range(len(self.engines)))  # whole: any worker
        route = self.routes[r.id] = _Route(r, now, _pick(self.loads, among, home_decode))
        if route.decode == home_decode:
            route.decode_cached = reusable(r.earlier_prompt + r.earlier_output, r.prompt, bt)
        self.loads[route.decode].add(r.prompt, 1)
        if not split:
            cached = route.decode_cached
            job = Job(r.id, r.prompt - cached, cached, r.output, p.memory_bytes(r.prompt + r.output))
            self._remember(r, route)
            self._at(arrive, self._enter, (self.engines[route.decode], job))
            return
        route.prefill = _pick(self.loads, self.prefillers, home_prefill)
        self._remember(r, route)
        self.loads[route.prefill].add(r.prompt, 1)
        computed = max(r.prompt - 1, 1)  # the prefill leg stops at token N-1 (vLLM computes at least one)
        cached = reusable(r.earlier_prompt - 1, computed, bt) if route.prefill == home_prefill else 0
        route.leg = Job(r.id, computed - cached, cached, 0, self.prefill_profile.memory_bytes(computed))
        self._at(arrive, self._enter, (self.engines[route.prefill], route.leg))

    def _remember(self, r: Request, route: _Route) -> None:
        """Where a conversation's turn went: its next turn finds its prefix there."""
        if r.conversation is not None:
            self.homes[r.conversation] = (route.decode, route.prefill)

    def _prefill_answered(self, now: float, route: _Route) -> None:
        """The prefill leg is done: the router sends the decode leg to the worker it picked on arrival."""
        p, r = self.decode_profile, route.request
        self.loads[route.prefill].add(r.prompt, -1)
        plan = p.transfer_plan(r.prompt, route.decode_cached, self.prefill_profile.tensor_parallel_size)
        held = plan.transferred_tokens + route.decode_cached  # pulled, and resumed from its own cache
        job = Job(r.id, r.prompt - held, held, r.output, p.memory_bytes(r.prompt + r.output))
        if plan.total_bytes:
            job.pull, job.pull_ms = "wanted", p.transfer.ms(plan.total_bytes)
        else:  # nothing moves: the decode worker computes the prompt itself
            self._release(now, self.engines[route.prefill], route.leg)
        self._at(now + p.handoff_ms, self._enter, (self.engines[route.decode], job))

    def _finished(self, now: float, route: _Route) -> None:
        r = route.request
        del self.routes[r.id]
        self.loads[route.decode].add(r.prompt, -1)
        self.outcomes.append(Outcome(r, route.sent_ms, route.first_ms, now))
        if (following := self.next_turn.pop(r.id, None)) is not None:
            self._send(now, following)
        elif self.unsent:
            self._send(now, self.unsent.popleft())
        elif self.later and not self.routes:
            self._next_phase(now)

    # --- the workers ---

    def _enter(self, now: float, arg: tuple[Engine, Job]) -> None:
        engine, job = arg
        engine.submit(job)
        self._poke(now, engine)

    def _release(self, now: float, engine: Engine, job: Job) -> None:
        engine.release(job)
        self._poke(now, engine)

    def _poke(self, now: float, engine: Engine) -> None:
        """Something reached ``engine``: its scheduler looks at the end of the step in progress, or now."""
        if engine.step is None:
            if engine not in self.planning:  # after the other events of this instant
                self.planning.add(engine)
                self._at(now, self._plan, engine)
        elif (shortened := engine.interrupt(now)) is not None:
            self._at(shortened.end_ms, self._step_end, (engine, shortened))

    def _plan(self, now: float, engine: Engine) -> None:
        self.planning.discard(engine)
        if engine.step is not None:
            return
        step, pulls = engine.plan(now)
        for job in pulls:
            self._at(engine.pull_posted_ms(now) + job.pull_ms, self._pulled, (engine, job))
        if step is not None:
            self._at(step.end_ms, self._step_end, (engine, step))

    def _pulled(self, now: float, arg: tuple[Engine, Job]) -> None:
        engine, job = arg
        engine.pulled(job)
        route = self.routes[job.request_id]
        self._release(now, self.engines[route.prefill], route.leg)
        self._poke(now, engine)

    def _step_end(self, now: float, arg: tuple[Engine, Step]) -> None:
        engine, step = arg
        if engine.step is not step:  # a run that was shortened since
            return
        sampled, done = engine.finish()
        for job in sampled:
            route = self.routes[job.request_id]
            if math.isnan(route.first_ms):  # not a preempted sequence computed again
                route.first_ms = now
        for job in done:
            route = self.routes[job.request_id]
            if job is route.leg:
                self._prefill_answered(now, route)
            else:
                engine.release(job)
                self._finished(now, route)
        self._poke(now, engine)
