"""Joining timeline traces into per-request segments (hybrid_pd/bench/timeline.py).

The traces are written here line by line as a router, a prefill and a decode worker's
processes write them (hybrid_pd/connector/trace/timeline.py), with the clocks given per event.
"""

from __future__ import annotations

import json

import pytest

from hybrid_pd.bench.budget import budget, budgets, format_budget
from hybrid_pd.bench.timeline import (
    CHAIN,
    EARLY_CHAIN,
    EARLY_SEGMENTS,
    HELD_CHAIN,
    HELD_SEGMENTS,
    RESIDUAL,
    SCHEDULER_CHAIN,
    SCHEDULER_SEGMENTS,
    SEGMENTS,
    load_events,
    request_group,
    router_spans,
    timelines,
)
from hybrid_pd.connector.trace.timeline import TimelineWriter


class _Proc:
    """One traced process: its file, and a monotonic clock that is ``offset`` behind its wall clock."""

    def __init__(self, directory, source: str, offset: float, pid: int) -> None:
        self.offset = offset
        self.path = directory / f"timeline-{source}-{pid}.jsonl"
        self.lines = [{"process": {"source": source, "host": "h", "pid": pid}}]

    def at(self, name: str, wall: float, **ids) -> None:
        self.lines.append({"ev": name, **ids, "mono": wall - self.offset, "wall": wall})

    def wall_only(self, name: str, wall: float, **ids) -> None:
        self.lines.append({"ev": name, **ids, "wall": wall})

    def save(self) -> None:
        self.path.write_text("".join(json.dumps(line) + "\n" for line in self.lines))


def _trace(tmp_path, rid: str = "run-endpoint-c1-0", t0: float = 1000.0, decode_clock_error: float = 0.0, skip: str | None = None, chain=CHAIN):
    """A whole P/D request: every event of the chain, 1 ms apart (2 ms for the transfer), in four processes."""
    for f in tmp_path.glob("timeline-*.jsonl"):
        f.unlink()
    router, prefill = _Proc(tmp_path, "router", 10.0, 1), _Proc(tmp_path, "prefill", 20.0, 2)
    decode_http, decode_engine = _Proc(tmp_path, "decode", 30.0, 3), _Proc(tmp_path, "decode", 30.0, 4)
    prefill_engine = _Proc(tmp_path, "prefill", 20.0, 5)
    req_p, req_d = f"cmpl-{rid}-0-aaaa", f"cmpl-{rid}-0-bbbb"
    t = t0
    for (source, name), segment_name, _ in chain:
        t += 0.002 if segment_name == "pull_transfer" else 0.001 if segment_name else 0
        if name == skip:
            continue
        if source == "router":
            router.at(name, t, rid=rid)
        elif name in ("http_in", "http_out"):
            (prefill if source == "prefill" else decode_http).at(name, t + (decode_clock_error if source == "decode" else 0), rid=rid)
        elif name == "engine_in":  # vLLM's arrival_time: the frontend's wall clock only
            (prefill_engine if source == "prefill" else decode_engine).wall_only(name, t + (decode_clock_error if source == "decode" else 0), rid=rid, req=req_p if source == "prefill" else req_d)
        elif source == "prefill":
            prefill_engine.at(name, t, rid=rid, req=req_p)
        elif name in ("pull_posted", "pull_done"):  # the model worker knows vLLM's id only
            decode_engine.at(name, t + decode_clock_error, req=req_d)
        else:
            decode_engine.at(name, t + decode_clock_error, rid=rid, req=req_d)
    for proc in (router, prefill, decode_http, decode_engine, prefill_engine):
        proc.save()
    return t - t0


def test_every_segment_of_a_whole_request_is_measured_and_they_add_up_to_the_routers_ttft(tmp_path):
    total = _trace(tmp_path)
    (found,) = timelines(load_events(tmp_path))
    assert found.rid == "run-endpoint-c1-0" and found.complete and not found.repeated
    assert found.ttft_s == pytest.approx(total)
    assert set(found.segments) == {s.name for s in SEGMENTS}
    assert found.segments["pull_transfer"] == pytest.approx(0.002)
    assert all(v == pytest.approx(0.001) for name, v in found.segments.items() if name != "pull_transfer")
    assert found.residual_s == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(
    ("chain", "segments", "kind"),
    [(EARLY_CHAIN, EARLY_SEGMENTS, "early"), (HELD_CHAIN, HELD_SEGMENTS, "held"), (SCHEDULER_CHAIN, SCHEDULER_SEGMENTS, "scheduler")],
    ids=["held-in-server", "held-in-engine-client", "held-in-scheduler"],
)
def test_an_early_decode_legs_request_is_measured_along_its_own_chain(tmp_path, chain, segments, kind):
    """The early leg went to the decode worker before the prefill leg: its trip is off the chain, the push on it. Held in
    vLLM's engine client, its parsing and rendering ran during the prefill too: off the chain, the release on it. Held in
    vLLM's scheduler, it reached the engine during the prefill as well: the push taken there is on the chain."""
    total = _trace(tmp_path, chain=chain)
    with (tmp_path / "timeline-router-1.jsonl").open("a") as f:  # the early leg's own trip, during the prefill
        f.write(json.dumps({"ev": "decode_sent", "rid": "run-endpoint-c1-0", "mono": 1000.0005 - 10.0, "wall": 1000.0005}) + "\n")
    if kind == "scheduler":  # the decode engine queued the leg during the prefill
        with (tmp_path / "timeline-decode-4.jsonl").open("a") as f:
            f.write(json.dumps({"ev": "queued", "rid": "run-endpoint-c1-0", "req": "cmpl-run-endpoint-c1-0-0-bbbb", "mono": 1000.0008 - 30.0, "wall": 1000.0008}) + "\n")
    (found,) = timelines(load_events(tmp_path))
    assert found.chain == kind and found.complete and found.ttft_s == pytest.approx(total)
    assert list(found.segments) == [s.name for s in segments]
    assert "handoff_push" in found.segments and "prefill_answer" not in found.segments
    assert ("decode_frontend" in found.segments) == (kind == "early") and ("handoff_release" in found.segments) == (kind == "held")
    assert ("decode_to_engine" in found.segments) == (kind != "scheduler")
    assert found.residual_s == pytest.approx(0.0, abs=1e-9)
    b = budget("g", [found])
    assert [r.name for r in b.rows] == [s.name for s in segments] + [RESIDUAL.name]


def test_the_routers_own_events_give_its_legs_and_ttft_whatever_the_workers_recorded(tmp_path):
    _trace(tmp_path)
    router_only = [e for e in load_events(tmp_path) if e.source == "router"]
    spans = router_spans(router_only)
    (found,) = timelines(load_events(tmp_path))
    assert spans["ttft"] == [pytest.approx(found.ttft_s)]
    names = [s.name for s in SEGMENTS]

    def summed(first: str, last: str) -> float:
        return sum(found.segments[n] for n in names[names.index(first) : names.index(last) + 1])

    assert spans["prefill_leg"] == [pytest.approx(summed("prefill_leg_in", "prefill_answer_in"))]
    assert spans["decode_leg"] == [pytest.approx(summed("decode_leg_in", "decode_first_byte_in"))]
    assert spans["after_prefill"] == [pytest.approx(summed("router_between_legs", "decode_first_byte_in"))]


def test_a_hosts_clock_error_moves_time_between_crossing_segments_but_not_the_total(tmp_path):
    _trace(tmp_path, decode_clock_error=0.0005)  # the decode host's wall clock runs 0.5 ms ahead
    (found,) = timelines(load_events(tmp_path))
    assert found.segments["decode_leg_in"] == pytest.approx(0.0015)  # into the decode host: + error
    assert found.segments["decode_first_byte_in"] == pytest.approx(0.0005)  # back out: - error
    assert found.segments["pull_transfer"] == pytest.approx(0.002)  # inside one process: its own clock
    assert sum(found.segments.values()) + found.residual_s == pytest.approx(found.ttft_s)
    assert found.residual_s == pytest.approx(0.0, abs=1e-9)


def test_a_missing_event_leaves_its_two_segments_unmeasured_and_their_time_in_the_residual(tmp_path):
    _trace(tmp_path, skip="pull_posted")
    (found,) = timelines(load_events(tmp_path))
    assert not found.complete
    assert found.segments["pull_post"] is None and found.segments["pull_transfer"] is None
    assert found.residual_s == pytest.approx(0.003)


def test_a_request_the_router_never_answered_has_no_row(tmp_path):
    _trace(tmp_path, skip="http_out")  # also the workers' http_out: the router's is what counts
    assert timelines(load_events(tmp_path)) == []


def test_tp_ranks_each_report_the_pull_the_first_post_and_the_last_completion_count(tmp_path):
    _trace(tmp_path)
    rank1 = _Proc(tmp_path, "decode", 30.0, 9)
    rank1.at("pull_posted", 1000.0142, req="cmpl-run-endpoint-c1-0-0-bbbb")  # after rank 0's (1000.014)
    rank1.at("pull_done", 1000.0165, req="cmpl-run-endpoint-c1-0-0-bbbb")  # after rank 0's (1000.016)
    rank1.save()
    (found,) = timelines(load_events(tmp_path))
    assert found.segments["pull_post"] == pytest.approx(0.001)
    assert found.segments["pull_transfer"] == pytest.approx(0.0025)
    assert found.segments["decode_row_wait"] == pytest.approx(0.0005)
    assert not found.repeated


def test_a_request_whose_legs_went_twice_is_marked_and_left_out_of_the_budget(tmp_path):
    _trace(tmp_path)
    again = _Proc(tmp_path, "router", 10.0, 1)
    again.lines = []
    again.at("decode_sent", 1000.0105, rid="run-endpoint-c1-0")  # a decode retry
    with again.path.open("a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in again.lines))
    found = timelines(load_events(tmp_path))
    assert [t.repeated for t in found] == [True]
    b = budget("g", found)
    assert b.repeated == 1 and b.requests == () and b.ttft.count == 0


def test_a_half_written_last_line_is_skipped(tmp_path):
    _trace(tmp_path)
    with (tmp_path / "timeline-router-1.jsonl").open("a") as f:
        f.write('{"ev":"http_in","rid":"run-endpoint-c1-1","mo')
    assert [t.rid for t in timelines(load_events(tmp_path))] == ["run-endpoint-c1-0"]


def test_the_budget_has_a_row_per_segment_the_residual_last_and_means_that_add_up_to_the_mean_ttft(tmp_path):
    for i in range(3):
        _trace(tmp_path, rid=f"run-endpoint-c1-{i}", t0=1000.0 + i)
        for f in tmp_path.glob("timeline-*.jsonl"):
            f.rename(tmp_path / f"{f.stem}-{i}.keep")
    for f in tmp_path.glob("*.keep"):
        f.rename(tmp_path / f"{f.stem}.jsonl")
    (b,) = budgets(tmp_path, prefix="run-")
    assert b.group == "run-endpoint-c1" and len(b.requests) == 3 and b.complete == 3
    assert [r.name for r in b.rows] == [s.name for s in SEGMENTS] + [RESIDUAL.name]
    assert all(r.count == 3 for r in b.rows)
    assert sum(r.mean for r in b.rows) == pytest.approx(b.ttft.mean)
    table = format_budget(b)
    assert table.splitlines()[-4].startswith("residual") and table.splitlines()[-2].startswith("TTFT")
    assert b.to_json()["segments"]["pull_transfer"]["p50_ms"] == pytest.approx(2.0)
    assert len(b.to_json()["per_request"]) == 3


def test_what_the_writer_writes_is_what_the_join_reads(tmp_path):
    writer = TimelineWriter(tmp_path, "decode")
    writer.event("queued", rid="r-1", req="cmpl-r-1-0-ab", mono=5.0)
    writer.event("engine_in", rid="r-1", req="cmpl-r-1-0-ab", wall=1000.0)
    writer.event("pull_done", req="cmpl-r-1-0-ab")
    queued, engine_in, pulled = load_events(tmp_path)
    assert (queued.source, queued.name, queued.rid, queued.req, queued.mono) == ("decode", "queued", "r-1", "cmpl-r-1-0-ab", 5.0)
    assert queued.wall - queued.mono == pytest.approx(pulled.wall - pulled.mono, abs=0.01)  # mono alone: wall from this process's clocks
    assert engine_in.mono is None and engine_in.wall == 1000.0
    assert pulled.rid is None and pulled.process == queued.process


@pytest.mark.parametrize(
    ("rid", "group"),
    [("a1b2-endpoint-c32-17", "a1b2-endpoint-c32"), ("a1b2-endpoint-r2.5-0", "a1b2-endpoint-r2.5"), ("0f3e9a", "all")],
)
def test_bench_request_ids_group_by_level(rid, group):
    assert request_group(rid) == group
