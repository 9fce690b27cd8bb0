"""Early decode legs held in vLLM's scheduler, real engines: the session stack's second decode worker (``--early-leg-hold
scheduler``, hybrid_pd/connector/vllm/scheduler_hold.py) behind a router of this module's own, in this process.

The early leg goes into the decode engine while the prefill runs; the prefill's engine pushes the state's whereabouts
over ZMQ to the decode engine's inbox, its scheduler takes them and pulls. It answers like the colocated server, with one
transfer, and the hand-off timeline follows that chain. A held leg that ends before its push (its client left, vLLM
refused it) leaves the engine serving: vLLM's NIXL connector fails on a leg whose prefill is not located (vLLM 0.32:
``KeyError: 'remote_block_ids'``, the decode engine down). Where the prefill does not reach the inbox, the push goes
through the decode worker's server (hybrid_pd/router/inbox_reach.py). This module sorts before ``test_router_resilience.py``, whose
last test kills a decode worker of the session stack (this one, as often as not).
"""

from __future__ import annotations

import dataclasses
import json
import uuid

import httpx
import pytest

from hybrid_pd.bench.router.fake_upstream import serve_in_thread
from hybrid_pd.bench.timeline import SCHEDULER_SEGMENTS, load_events, timelines
from hybrid_pd.connector.contract import HANDOFF_KEY_PARAM, HANDOFF_PATH
from hybrid_pd.connector.trace.http import TimelineMiddleware
from hybrid_pd.connector.trace.timeline import writer_for
from hybrid_pd.router.app import RouterApp, create_app
from hybrid_pd.router.registry import Worker
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.stack import Stack
from tests.e2e.support import metric, settled, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

XFERS, WAITING = "vllm:nixl_xfer_time_seconds_count", "vllm:num_requests_waiting"
PROMPT = [(19 + 17 * i) % 480 + 10 for i in range(150)]  # a start no other module's prompts use


@pytest.fixture(scope="module")
def held(stack: Stack, timeline_dir) -> tuple[str, httpx.Client]:
    """A router over the session's prefill worker and its scheduler-held decode worker: its URL, and a client of that decode worker."""
    prefill, decode = stack.workers("prefill")[0].url, stack.workers("decode")[1].url
    probe = httpx.get(decode + HANDOFF_PATH, timeout=10).json()
    assert probe["inbox"].startswith("tcp://127.0.0.1:"), probe  # its engine takes the pushes
    settings = RouterSettings(prefill=[prefill], decode=[decode], timeline_dir=str(timeline_dir))
    router = create_app(settings)
    app = TimelineMiddleware(router, writer_for(str(timeline_dir), "router"))  # as `hybrid-pd router --timeline-dir`
    with serve_in_thread(app, lifespan="on") as url, httpx.Client(base_url=decode, timeout=120) as client:
        available = lambda: httpx.get(url + "/health").json()["available"]  # noqa: E731
        assert wait_for(lambda: len(available()["prefill"]) == len(available()["decode"]) == 1, timeout_s=60)
        # The prefill worker said it reaches the inbox (hybrid_pd/router/inbox_reach.py): its engine pushes straight there.
        assert wait_for(lambda: _prefill(router).inboxes.get(probe["inbox"], (False,))[0], timeout_s=30)
        yield url, client


def _prefill(router: RouterApp) -> Worker:
    return router.state.router.registry.role("prefill")[0]


def _greedy(base_url: str, prompt: list[int], request_id: str | None = None, timeout_s: float = 120) -> tuple[list[int], list[float]]:
    body = {"model": "hybrid-pd-tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1, "return_token_ids": True}
    headers = {"X-Request-Id": request_id} if request_id else {}
    r = httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=timeout_s)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _answers_like_colocated(router_url: str, decode: httpx.Client, colocated: httpx.Client, prompt: list[int], rid: str) -> None:
    before = settled(lambda: metric(decode, XFERS))
    tokens, logprobs = _greedy(router_url, prompt, rid)
    reference, reference_logprobs = _greedy(str(colocated.base_url), prompt)
    assert tokens == reference
    assert max(abs(a - b) for a, b in zip(logprobs, reference_logprobs, strict=True)) < 1e-4
    assert settled(lambda: metric(decode, XFERS)) == before + 1  # pulled, not computed here


def _streamed_text(base_url: str, prompt: list[int], request_id: str) -> str:
    body = {"model": "hybrid-pd-tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


def test_a_leg_held_in_the_scheduler_answers_like_colocated_with_one_pull_and_its_push_taken_by_the_engine(held, colocated, timeline_dir):
    router_url, decode = held
    _answers_like_colocated(router_url, decode, colocated, PROMPT[:120], f"sched-{uuid.uuid4().hex[:8]}")
    # Streamed (the timeline has a row for each request the router answered as a stream).
    rids = [f"sched-{uuid.uuid4().hex[:8]}-{i}" for i in range(2)]
    for i, rid in enumerate(rids):
        prompt = PROMPT[: 130 + 10 * i]
        before = settled(lambda: metric(decode, XFERS))
        reference = colocated.post("/v1/completions", json={"model": "hybrid-pd-tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert _streamed_text(router_url, prompt, rid) == reference.json()["choices"][0]["text"]
        assert settled(lambda: metric(decode, XFERS)) == before + 1
    assert wait_for(lambda: {t.rid for t in timelines(load_events(timeline_dir))} >= set(rids), timeout_s=10)
    rows = {t.rid: t for t in timelines(load_events(timeline_dir)) if t.rid in rids}
    for rid, row in rows.items():
        assert row.chain == "scheduler" and row.complete, (rid, row.segments)
        assert list(row.segments) == [s.name for s in SCHEDULER_SEGMENTS]
        assert min(row.segments.values()) >= -0.0005, row.segments  # every event after the one before it


def _held_leg(max_tokens: int, stream: bool) -> dict:
    """A leg as the router's early one, for a push that never comes."""
    params = {"do_remote_prefill": True, HANDOFF_KEY_PARAM: uuid.uuid4().hex}
    return {"model": "hybrid-pd-tiny", "prompt": PROMPT[:40], "max_tokens": max_tokens, "stream": stream, "kv_transfer_params": params}


def test_a_held_leg_that_ends_before_its_push_leaves_the_decode_engine_serving(held, colocated):
    router_url, decode = held
    # Its client leaves while the scheduler holds it.
    with httpx.Client(base_url=str(decode.base_url), timeout=30) as client, client.stream("POST", "/v1/completions", json=_held_leg(4, True)) as r:
        assert r.status_code == 200
        assert wait_for(lambda: metric(decode, WAITING) == 1, timeout_s=30), "the leg is not held in the scheduler"
    assert wait_for(lambda: metric(decode, WAITING) == 0, timeout_s=30), "the abandoned leg stayed held"
    # vLLM refuses it (more tokens than the model's length): vLLM hands its parameters to the engine all the same.
    refused = decode.post("/v1/completions", json=_held_leg(10**6, False))
    assert refused.status_code == 400, refused.text
    _answers_like_colocated(router_url, decode, colocated, PROMPT[:90], f"sched-after-{uuid.uuid4().hex[:8]}")


def test_where_the_prefill_does_not_reach_the_decode_engines_inbox_the_push_goes_through_the_decode_server(stack, colocated, unused_tcp_port):
    """The inbox's address the router has is not one the prefill's host reaches (here a closed port; in a deployment a
    firewall, a host it cannot resolve). ZMQ would queue the pushes there and say nothing: each leg waited out the 120 s
    limit. The prefill says it does not reach it; the push goes to the decode worker's server, which relays it to its engine."""
    prefill, decode = stack.workers("prefill")[0].url, stack.workers("decode")[1].url
    router = create_app(RouterSettings(prefill=[prefill], decode=[decode]))
    with serve_in_thread(router, lifespan="on") as url, httpx.Client(base_url=decode, timeout=120) as client:
        registry = router.state.router.registry
        assert wait_for(lambda: all(w.identity.handoff_inbox is not None for w in registry.role("decode")), timeout_s=60)
        unreachable = f"tcp://127.0.0.1:{unused_tcp_port}"
        worker = registry.role("decode")[0]
        worker.identity = dataclasses.replace(worker.identity, handoff_inbox=unreachable)
        assert wait_for(lambda: _prefill(router).inboxes.get(unreachable, (None,))[0] is False, timeout_s=30)
        before = settled(lambda: metric(client, XFERS))
        tokens, _ = _greedy(url, PROMPT[:110], f"sched-unreached-{uuid.uuid4().hex[:8]}", timeout_s=60)  # not 120 s
        reference, _ = _greedy(str(colocated.base_url), PROMPT[:110])
        assert tokens == reference
        assert settled(lambda: metric(client, XFERS)) == before + 1  # pulled, not computed here
