"""What the traced processes record (hybrid_pd/connector/trace/http.py, hybrid_pd/connector/vllm/timeline_engine.py), without vLLM.

The HTTP edge is driven as an ASGI app is; the engine side gets stand-ins with the
attributes vLLM's ``Request`` and its engine events have (``request_id``,
``kv_transfer_params``, ``arrival_time``, ``events`` of ``(type.name, timestamp)``).
"""

from __future__ import annotations

import asyncio
from enum import Enum
from types import SimpleNamespace

from hybrid_pd.bench.timeline import load_events
from hybrid_pd.connector.trace.http import TimelineMiddleware
from hybrid_pd.connector.trace.timeline import REQUEST_ID_PARAM, TimelineWriter
from hybrid_pd.connector.vllm.timeline_engine import EngineTimeline, vllm_event_time


def _events(directory) -> list[tuple]:
    return [(e.name, e.rid, e.req) for e in load_events(directory)]


def _serve(middleware: TimelineMiddleware, request_headers: list, answer: list) -> list:
    sent: list = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        for message in answer:
            await send(message)

    middleware.app = app
    asyncio.run(middleware({"type": "http", "headers": request_headers}, receive, send))
    return sent


def _start(*headers):
    return {"type": "http.response.start", "status": 200, "headers": list(headers)}


def test_the_http_edge_records_arrival_and_first_byte_by_the_request_id_it_came_with(tmp_path):
    middleware = TimelineMiddleware(None, TimelineWriter(tmp_path, "prefill"))
    answer = [_start(), {"type": "http.response.body", "body": b"", "more_body": True},
              {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True},
              {"type": "http.response.body", "body": b"data: 2\n\n", "more_body": False}]  # fmt: skip
    assert _serve(middleware, [(b"x-request-id", b"r-7")], answer) == answer  # passed on unchanged
    assert _events(tmp_path) == [("http_in", "r-7", None), ("http_out", "r-7", None)]
    http_in, http_out = load_events(tmp_path)
    assert http_out.mono >= http_in.mono


def test_the_http_edge_takes_the_answers_id_when_the_request_had_none_and_skips_requests_without_one(tmp_path):
    middleware = TimelineMiddleware(None, TimelineWriter(tmp_path, "router"))
    _serve(middleware, [], [_start((b"x-request-id", b"made-here")), {"type": "http.response.body", "body": b"{}"}])
    _serve(middleware, [], [_start(), {"type": "http.response.body", "body": b"ok"}])  # a health check
    assert _events(tmp_path) == [("http_in", "made-here", None), ("http_out", "made-here", None)]


def test_the_http_edge_is_a_pass_through_when_no_writer_is_configured(monkeypatch):
    monkeypatch.delenv("HYBRID_PD_TIMELINE_DIR", raising=False)
    middleware = TimelineMiddleware(None)
    assert middleware.writer is None
    answer = [_start(), {"type": "http.response.body", "body": b"x"}]
    assert _serve(middleware, [(b"x-request-id", b"r")], answer) == answer


class _Kind(Enum):
    QUEUED = 1
    SCHEDULED = 2


def _request(req: str, rid: str | None, *events: tuple[_Kind, float]):
    params = {"do_remote_prefill": True} | ({REQUEST_ID_PARAM: rid} if rid else {})
    return SimpleNamespace(request_id=req, kv_transfer_params=params, arrival_time=900.0,
                           events=[SimpleNamespace(type=k, timestamp=t) for k, t in events])  # fmt: skip


def test_vllms_engine_event_times_are_read_by_their_type_name():
    request = _request("q", "r", (_Kind.QUEUED, 1.0), (_Kind.SCHEDULED, 2.0), (_Kind.SCHEDULED, 3.0))
    assert vllm_event_time(request, "QUEUED") == 1.0 and vllm_event_time(request, "SCHEDULED") == 3.0
    assert vllm_event_time(SimpleNamespace(), "QUEUED") is None  # a vLLM that keeps no events


def test_a_decode_engine_records_each_step_of_a_pull_once_with_vllms_timestamps(tmp_path):
    engine = EngineTimeline(TimelineWriter(tmp_path, "decode"), prefill=False)
    request = _request("cmpl-r-0-ab", "r", (_Kind.QUEUED, 50.0))
    engine.seen(request)
    engine.seen(request)  # the scheduler looks again while it waits
    engine.pull_queued(request)
    engine.step({"other": 1})  # not scheduled while its pull runs
    engine.posted(["cmpl-r-0-ab"])
    engine.posted(["cmpl-r-0-ab"])  # still in flight at the next step
    engine.pulled(["cmpl-r-0-ab"])
    engine.pulled(["cmpl-r-0-ab"])  # a vLLM whose get_transfer_results asks get_finished: once only
    request.events.append(SimpleNamespace(type=_Kind.SCHEDULED, timestamp=60.0))
    engine.step({"cmpl-r-0-ab": 1})
    engine.step({"cmpl-r-0-ab": 1})
    engine.finished(request)  # a decode worker's request_finished is not the timeline's "done"
    assert _events(tmp_path) == [
        ("engine_in", "r", "cmpl-r-0-ab"), ("queued", "r", "cmpl-r-0-ab"), ("pull_queued", "r", "cmpl-r-0-ab"),
        ("pull_posted", None, "cmpl-r-0-ab"), ("pull_done", None, "cmpl-r-0-ab"), ("scheduled", "r", "cmpl-r-0-ab"),
    ]  # fmt: skip
    by_name = {e.name: e for e in load_events(tmp_path)}
    assert by_name["engine_in"].wall == 900.0 and by_name["engine_in"].mono is None
    assert by_name["queued"].mono == 50.0 and by_name["scheduled"].mono == 60.0


def test_a_prefill_engine_records_done_and_ignores_requests_the_router_did_not_name(tmp_path):
    engine = EngineTimeline(TimelineWriter(tmp_path, "prefill"), prefill=True)
    named, unnamed = _request("cmpl-p-0-cd", "p"), _request("cmpl-x-0-ef", None)
    for request in (named, unnamed):
        engine.seen(request)
        engine.step({request.request_id: 3})
        engine.finished(request)
    engine.pulled([], failed=["cmpl-d-0-01"])  # a failed pull is recorded even when nothing was posted
    names = [(name, rid) for name, rid, _ in _events(tmp_path)]
    assert names == [("engine_in", "p"), ("queued", "p"), ("scheduled", "p"), ("done", "p"), ("pull_failed", None)]


def test_a_forked_process_gets_a_writer_and_a_file_of_its_own(tmp_path):
    import os

    from hybrid_pd.connector.trace.timeline import writer_for

    parent = writer_for(str(tmp_path), "decode")
    assert writer_for(str(tmp_path), "decode") is parent
    child = os.fork()
    if child == 0:  # the child: write one event through the cached factory, and leave without cleanup
        writer_for(str(tmp_path), "decode").event("queued", rid="r")
        os._exit(0)
    os.waitpid(child, 0)
    files = sorted(p.name for p in tmp_path.glob("timeline-decode-*.jsonl"))
    assert files == sorted([f"timeline-decode-{os.getpid()}.jsonl", f"timeline-decode-{child}.jsonl"])
    assert [e.process[1] for e in load_events(tmp_path)] == [child]
