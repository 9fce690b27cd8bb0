"""Hand-off timelines: the trace files of a P/D deployment joined into per-request segments.

The router and both workers, started with ``--timeline-dir``, each append their own events
(:mod:`hybrid_pd.connector.trace.timeline`). Here they become, per request, one contiguous chain from the
router's arrival to its first byte to the client:

    router.http_in -> router.prefill_sent -> prefill.http_in -> prefill.engine_in -> ... -> router.http_out

(:data:`CHAIN`; each link is a :class:`Segment`). An early decode leg (sent with the prefill leg,
held until the prefill's engine pushes the state's whereabouts: ``hybrid_pd/connector/vllm/handoff.py``)
has a chain of its own: from the prefill's end it goes through the push (``handoff_in``) to the
decode's engine; the early leg's own trip to the decode worker ran during the prefill, off the
chain. Held in the decode worker's server (:data:`EARLY_CHAIN`), it is parsed and rendered after
the push; held in vLLM's engine client (:data:`HELD_CHAIN`, ``handoff_released``), it was parsed
and rendered during the prefill, off the chain too; held in vLLM's scheduler (:data:`SCHEDULER_CHAIN`,
``handoff_taken``), it reached the engine during the prefill and the push goes to the engine itself. The router's TTFT (``http_in`` to
``http_out`` on its monotonic clock) is the total; the segments telescope, so they add up to
it exactly when every event is there, and what a missing event leaves uncovered is the
``residual``, shown as a segment of its own, never spread over the others.

Clocks: a segment between two events of one process is a difference of that process's
``time.monotonic()``; a segment from one process to another is a difference of wall clocks
(``time.time()``), the only clock two processes share. On one host that is exact; across
hosts each crossing segment carries the two hosts' clock offset (NTP: well under a
millisecond, but not zero), and the crossing into a host and the one back out carry it with
opposite signs, so their sum and the total stay right. A few events come from vLLM's wall
clock only (``engine_in``, vLLM's ``arrival_time``): their segments are wall differences.

Which requests: one row per request the router answered as a stream (it saw both its
``http_in`` and ``http_out``). A request whose legs were sent twice (a decode retry) is
``repeated`` and left out of budgets, as is one without a P/D pair (local prefill).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHAIN", "CHAINS", "EARLY_CHAIN", "EARLY_SEGMENTS", "HELD_CHAIN", "HELD_SEGMENTS", "SCHEDULER_CHAIN", "SCHEDULER_SEGMENTS", "Event",
           "ROUTER_SPANS", "RequestTimeline", "Segment", "SEGMENTS", "join", "load_events", "request_group", "router_spans", "timelines"]

Mark = tuple[str, str]  # (source, event)


@dataclass(frozen=True)
class Segment:
    """The time from ``start`` to ``end`` of one request: ``name`` in JSON, ``label`` in tables."""

    name: str
    label: str
    start: Mark
    end: Mark


# The events of a P/D request in the order they happen, with the segment each one ends.
_PREFILL_LEG: tuple[tuple[Mark, str, str], ...] = (
    (("router", "http_in"), "", ""),
    (("router", "prefill_sent"), "router_to_prefill_leg", "router: arrival -> prefill leg sent (pairing, body)"),
    (("prefill", "http_in"), "prefill_leg_in", "prefill leg: router -> prefill's vLLM server"),
    (("prefill", "engine_in"), "prefill_frontend", "prefill: request parsed, prompt rendered (vLLM frontend)"),
    (("prefill", "queued"), "prefill_to_engine", "prefill: frontend -> engine core"),
    (("prefill", "scheduled"), "prefill_queue", "prefill: queued -> scheduled"),
    (("prefill", "done"), "prefill_forward", "prefill: forward, token sampled, state held"),
)
_DECODE_FRONTEND: tuple[tuple[Mark, str, str], ...] = (
    (("decode", "engine_in"), "decode_frontend", "decode: request parsed, prompt rendered (vLLM frontend)"),
    (("decode", "queued"), "decode_to_engine", "decode: frontend -> engine core"),
)
_DECODE_ENGINE: tuple[tuple[Mark, str, str], ...] = (
    (("decode", "pull_queued"), "decode_queue", "decode: queued -> pull allocated"),
    (("decode", "pull_posted"), "pull_post", "decode: pull handed to the model worker, posted"),
    (("decode", "pull_done"), "pull_transfer", "decode: transfer, completion noticed"),
    (("decode", "scheduled"), "decode_row_wait", "decode: pull done -> decode-row step scheduled"),
    (("decode", "http_out"), "decode_row_out", "decode: decode row forward, token N out as the first event"),
    (("router", "decode_first_byte"), "decode_first_byte_in", "decode first byte -> router"),
    (("router", "http_out"), "router_relay", "router: first byte relayed to the client"),
)
CHAIN: tuple[tuple[Mark, str, str], ...] = (
    *_PREFILL_LEG,
    (("prefill", "http_out"), "prefill_answer", "prefill: engine output -> answer written"),
    (("router", "prefill_answered"), "prefill_answer_in", "prefill answer -> router, read"),
    (("router", "decode_sent"), "router_between_legs", "router: between the legs"),
    (("decode", "http_in"), "decode_leg_in", "decode leg: router -> decode's vLLM server"),
    *_DECODE_FRONTEND,
    *_DECODE_ENGINE,
)
_PUSH: tuple[Mark, str, str] = (("decode", "handoff_in"), "handoff_push", "prefill's engine -> its push at the decode's server")
EARLY_CHAIN: tuple[tuple[Mark, str, str], ...] = (*_PREFILL_LEG, _PUSH, *_DECODE_FRONTEND, *_DECODE_ENGINE)
HELD_CHAIN: tuple[tuple[Mark, str, str], ...] = (
    *_PREFILL_LEG,
    _PUSH,
    (("decode", "handoff_released"), "handoff_release", "decode: push -> the early leg, rendered meanwhile, released in vLLM's engine client"),
    (("decode", "queued"), "decode_to_engine", "decode: engine client -> engine core"),
    *_DECODE_ENGINE,
)

# Held in vLLM's scheduler (hybrid_pd/connector/vllm/scheduler_hold.py): the leg reached the engine during the prefill; the
# push goes to the engine itself.
SCHEDULER_CHAIN: tuple[tuple[Mark, str, str], ...] = (
    *_PREFILL_LEG,
    (("decode", "handoff_taken"), "handoff_push", "prefill's engine -> its push taken by the decode's scheduler"),
    *_DECODE_ENGINE,
)


def _segments(chain: tuple[tuple[Mark, str, str], ...]) -> tuple[Segment, ...]:
    return tuple(Segment(name, label, chain[i - 1][0], mark) for i, (mark, name, label) in enumerate(chain) if i > 0)


SEGMENTS = _segments(CHAIN)
EARLY_SEGMENTS = _segments(EARLY_CHAIN)
HELD_SEGMENTS = _segments(HELD_CHAIN)
SCHEDULER_SEGMENTS = _segments(SCHEDULER_CHAIN)
# Each request's chain by name (RequestTimeline.chain): the legs one after the other, an early leg held in the server, in the
# engine client, or in the scheduler.
CHAINS: dict[str, tuple[Segment, ...]] = {"sequential": SEGMENTS, "early": EARLY_SEGMENTS, "held": HELD_SEGMENTS, "scheduler": SCHEDULER_SEGMENTS}
RESIDUAL = Segment("residual", "residual (TTFT not covered by the segments above)", CHAIN[0][0], CHAIN[-1][0])

# Events a TP group's every rank writes: the pull is posted when the first rank posts and done when the last is.
_FIRST_OF_RANKS, _LAST_OF_RANKS = "pull_posted", "pull_done"


@dataclass(frozen=True)
class Event:
    """One traced event: ``process`` is (host, pid) of the process that wrote it; ``mono`` is on that process's clock."""

    source: str
    name: str
    rid: str | None
    req: str | None
    mono: float | None
    wall: float
    process: tuple[str, int]


def load_events(directory: str | Path) -> list[Event]:
    """Every event of every ``timeline-*.jsonl`` in ``directory``; a half-written last line is skipped."""
    events = []
    for path in sorted(Path(directory).glob("timeline-*.jsonl")):
        source, process = None, None
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "process" in record:
                source, process = record["process"]["source"], (record["process"]["host"], record["process"]["pid"])
            elif source is not None and process is not None:
                events.append(Event(source, record["ev"], record.get("rid"), record.get("req"), record.get("mono"), record["wall"], process))
    return events


@dataclass(frozen=True)
class Marks:
    """One request's events by (source, event), and whether any was recorded more than once."""

    events: Mapping[Mark, Event]
    repeated: bool


def join(events: Iterable[Event]) -> dict[str, Marks]:
    """The events of each request (by the router's id); model-worker events reach theirs through vLLM's id.

    A TP group's ranks each post and complete a pull: the first post and the last completion
    count. Any other event seen twice marks the request ``repeated`` (the first one is kept).
    """
    events = list(events)
    rid_of = {(e.source, e.req): e.rid for e in events if e.rid is not None and e.req is not None}
    found: dict[str, dict[Mark, Event]] = {}
    repeated: set[str] = set()
    for e in events:
        rid = e.rid if e.rid is not None else rid_of.get((e.source, e.req))
        if rid is None:
            continue
        marks = found.setdefault(rid, {})
        key = (e.source, e.name)
        kept = marks.get(key)
        if kept is None:
            marks[key] = e
        elif e.name == _FIRST_OF_RANKS:
            marks[key] = min(kept, e, key=lambda x: x.wall)
        elif e.name == _LAST_OF_RANKS:
            marks[key] = max(kept, e, key=lambda x: x.wall)
        else:
            repeated.add(rid)
    return {rid: Marks(marks, rid in repeated) for rid, marks in found.items()}


# What a router alone records of a P/D request, (first event, last event) each: the spans a trace of the router's
# events only gives (``hybrid_pd/bench/gpu/goodput.py --router-timeline``), whatever the workers record.
ROUTER_SPANS: dict[str, tuple[str, str]] = {
    "prefill_leg": ("prefill_sent", "prefill_answered"),
    "decode_leg": ("decode_sent", "decode_first_byte"),  # an early leg's starts before the prefill leg's
    "after_prefill": ("prefill_answered", "decode_first_byte"),  # the prefill's answer in, to the decode's first byte
    "ttft": ("http_in", "http_out"),
}


def router_spans(events: Iterable[Event]) -> dict[str, list[float]]:
    """Seconds of each of :data:`ROUTER_SPANS`, over the requests whose router recorded both its events (legs sent twice left out)."""
    spans: dict[str, list[float]] = {name: [] for name in ROUTER_SPANS}
    for marks in join(e for e in events if e.source == "router").values():
        if marks.repeated:
            continue
        for name, (first, last) in ROUTER_SPANS.items():
            start, end = marks.events.get(("router", first)), marks.events.get(("router", last))
            if start is not None and end is not None:
                spans[name].append(between(start, end))
    return spans


def between(start: Event, end: Event) -> float:
    """Seconds from ``start`` to ``end``: monotonic within one process, wall clock across processes."""
    if start.process == end.process and start.mono is not None and end.mono is not None:
        return end.mono - start.mono
    return end.wall - start.wall


@dataclass(frozen=True)
class RequestTimeline:
    """One request's segments (seconds; None where an event is missing) and the router's TTFT they add up to."""

    rid: str
    ttft_s: float
    segments: Mapping[str, float | None]
    residual_s: float
    repeated: bool
    chain: str = "sequential"  # which of CHAINS its segments follow

    @property
    def complete(self) -> bool:
        """Every segment measured: a P/D request, all of whose events were recorded."""
        return all(v is not None for v in self.segments.values())

    def to_json(self) -> dict[str, object]:
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1e3, 4)

        out: dict[str, object] = {"rid": self.rid, "chain": self.chain, "ttft_ms": ms(self.ttft_s)}
        out["segments_ms"] = {name: ms(v) for name, v in self.segments.items()} | {RESIDUAL.name: ms(self.residual_s)}
        if self.repeated:
            out["repeated"] = True
        return out


def request_timeline(rid: str, marks: Marks) -> RequestTimeline | None:
    """``rid``'s segments; None unless the router saw it arrive and answered its first byte."""
    arrived, answered = marks.events.get(RESIDUAL.start), marks.events.get(RESIDUAL.end)
    if arrived is None or answered is None:
        return None
    ttft = between(arrived, answered)
    chain = ("scheduler" if ("decode", "handoff_taken") in marks.events else "held" if ("decode", "handoff_released") in marks.events
             else "early" if ("decode", "handoff_in") in marks.events else "sequential")  # fmt: skip
    segments: dict[str, float | None] = {}
    for segment in CHAINS[chain]:
        start, end = marks.events.get(segment.start), marks.events.get(segment.end)
        segments[segment.name] = None if start is None or end is None else between(start, end)
    residual = ttft - sum(v for v in segments.values() if v is not None)
    return RequestTimeline(rid, ttft, segments, residual, marks.repeated, chain)


def timelines(events: Iterable[Event], rids: Iterable[str] | None = None) -> list[RequestTimeline]:
    """The timeline of every request the router answered (of ``rids`` only, if given), in id order."""
    joined = join(events)
    wanted = sorted(joined) if rids is None else [r for r in rids if r in joined]
    found = (request_timeline(rid, joined[rid]) for rid in wanted)
    return [t for t in found if t is not None]


_NUMBERED = re.compile(r"^(.+)-\d+$")


def request_group(rid: str) -> str:
    """The group of a numbered request id (``hybrid-pd bench``'s ``<run>-<target>-<load>-<i>``: all but ``-<i>``); else ``all``."""
    match = _NUMBERED.match(rid)
    return match.group(1) if match else "all"


def grouped(found: Sequence[RequestTimeline]) -> dict[str, list[RequestTimeline]]:
    """``found`` by :func:`request_group`, groups in order of first appearance."""
    groups: dict[str, list[RequestTimeline]] = {}
    for t in found:
        groups.setdefault(request_group(t.rid), []).append(t)
    return groups
