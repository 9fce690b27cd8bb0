"""The early decode leg, router side (issue #35): both legs at once where both workers take part, scripted workers.

The decode worker's side (holding the leg until the prefill's push) is tests/test_handoff.py; real
engines exchanging real state with early legs are every e2e test of the session stack
(tests/e2e: the router's default is on).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from hybrid_pd.connector.contract import HANDOFF_KEY_HEADER, HANDOFF_KEY_PARAM, HANDOFF_REACH_QUERY, HANDOFF_URL_PARAM
from hybrid_pd.connector.trace.timeline import REQUEST_ID_PARAM
from hybrid_pd.router.app import RouterApp
from tests.router_support import DECODE, Workers, asgi_client, probed, router_app


@pytest.fixture
def early_workers() -> Workers:
    workers = Workers()
    workers.handoff = True
    return workers


@pytest.fixture
async def early(early_workers: Workers) -> AsyncIterator[tuple[httpx.AsyncClient, RouterApp]]:
    app = router_app(early_workers)
    async with app.router.lifespan_context(app):
        await probed(app, lambda w: w.identity.handoff is not None)
        async with asgi_client(app) as c:
            yield c, app


def _inflight(app: RouterApp) -> list[int]:
    return [w.inflight for w in app.state.router.registry.all()]


async def test_the_decode_leg_is_in_flight_while_the_prefill_runs_and_both_legs_carry_one_key(early_workers):
    decode_sent = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.host == "decode.test":
            decode_sent.set()
        if request.method == "POST" and request.url.host == "prefill.test":
            await asyncio.wait_for(decode_sent.wait(), 5)  # the prefill answers only once the decode leg is out
        return early_workers(request)

    app = router_app(handler)
    async with app.router.lifespan_context(app):
        await probed(app, lambda w: w.identity.handoff is not None)
        async with asgi_client(app) as client:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8}, headers={"X-Request-Id": "r1"})
            metrics = (await client.get("/metrics")).text
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " decoded"
    legs = {worker: body for worker, body, _ in early_workers.calls}
    assert len(early_workers.calls) == 2
    key = legs["decode"]["kv_transfer_params"][HANDOFF_KEY_PARAM]
    assert legs["decode"] == {"model": "m", "prompt": "hi", "max_tokens": 8,
                              "kv_transfer_params": {"do_remote_prefill": True, HANDOFF_KEY_PARAM: key, REQUEST_ID_PARAM: "r1"}}  # fmt: skip
    prefill_params = legs["prefill"]["kv_transfer_params"]
    assert prefill_params[HANDOFF_KEY_PARAM] == key and prefill_params[HANDOFF_URL_PARAM] == DECODE
    headers = {worker: h for worker, _, h in early_workers.calls}  # the early leg says so: the decode server reads it only
    assert headers["decode"][HANDOFF_KEY_HEADER] == key and HANDOFF_KEY_HEADER not in headers["prefill"]
    assert legs["prefill"]["max_tokens"] == 1 and prefill_params["do_remote_decode"] is True
    # The prefill's usage still reaches the client: its cached tokens are the prefill's.
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert _inflight(app) == [0, 0]
    assert 'hybrid_pd_disaggregated_total{reason="disaggregated"} 1.0' in metrics


@pytest.mark.parametrize(("inbox", "reaches", "pushed_to"), [("tcp://10.0.0.7:6123", True, "inbox"), ("tcp://10.0.0.7:6123", False, DECODE),
                                                            ("tcp://10.0.0.7:6123", None, DECODE), ("not-a-zmq-address", True, DECODE)])  # fmt: skip
async def test_the_prefill_pushes_to_the_decode_engines_inbox_where_its_probe_names_one_the_prefill_reaches(early_workers, inbox, reaches, pushed_to):
    """A decode worker whose scheduler holds early legs (hybrid_pd/connector/vllm/scheduler_hold.py) names its engine's inbox
    in the probe's answer: the prefill pushes there once its server said its host reaches it (hybrid_pd/router/inbox_reach.py),
    else to the decode worker's server, which relays it (a prefill that does not answer the question, another version: no).
    Anything but a tcp:// address is not an inbox, and nobody is asked of it."""
    early_workers.inbox, early_workers.reaches = inbox, reaches
    app = router_app(early_workers)
    async with app.router.lifespan_context(app):
        await probed(app, lambda w: w.identity.handoff is not None)
        if inbox.startswith("tcp://"):
            await probed(app, lambda w: w.role == "decode" or inbox in w.inboxes)
        async with asgi_client(app) as client:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8})
        views = [w.view() for w in app.state.router.registry.all()]  # as GET /admin/workers shows them
    assert r.status_code == 200
    legs = {worker: body for worker, body, _ in early_workers.calls}
    assert legs["prefill"]["kv_transfer_params"][HANDOFF_URL_PARAM] == (inbox if pushed_to == "inbox" else pushed_to)
    assert early_workers.reach_asked == ([inbox] if inbox.startswith("tcp://") else [])  # once: a no is asked again only later
    prefill = next(v for v in views if v["role"] == "prefill")
    assert prefill.get("reaches_inboxes") == ({inbox: reaches is True} if inbox.startswith("tcp://") else None)


async def test_until_the_prefill_has_said_it_reaches_the_inbox_it_pushes_to_the_decode_workers_server(early_workers):
    answer = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.params.get(HANDOFF_REACH_QUERY) is not None:
            await answer.wait()
        return early_workers(request)

    early_workers.inbox, early_workers.reaches = "tcp://10.0.0.7:6123", True
    app = router_app(handler)
    async with app.router.lifespan_context(app):
        await probed(app, lambda w: w.identity.handoff is not None)
        async with asgi_client(app) as client:
            await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
            answer.set()
            await probed(app, lambda w: w.role == "decode" or bool(w.inboxes))
            await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
            metrics = (await client.get("/metrics")).text
    pushed_to = [body["kv_transfer_params"][HANDOFF_URL_PARAM] for worker, body, _ in early_workers.calls if worker == "prefill"]
    assert pushed_to == [DECODE, "tcp://10.0.0.7:6123"]
    assert 'hybrid_pd_early_legs_total{push="server"} 1.0' in metrics and 'hybrid_pd_early_legs_total{push="inbox"} 1.0' in metrics


async def test_every_pair_gets_its_own_key(early, early_workers):
    client, _ = early
    for _ in range(2):
        await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    keys = {body["kv_transfer_params"][HANDOFF_KEY_PARAM] for _, body, _ in early_workers.calls}
    assert len(keys) == 2


@pytest.mark.parametrize("failure", [httpx.ConnectError("connection refused"), httpx.Response(500, json={})])
async def test_a_failed_prefill_closes_the_early_leg_and_the_decode_worker_prefills_locally(early, early_workers, failure):
    client, app = early
    early_workers.prefill_response = failure
    body = {"model": "m", "prompt": "hi", "max_tokens": 8}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200
    # The early leg may be cancelled before it is sent; the last leg is the client's request, without parameters.
    assert early_workers.calls[-1][:2] == ("decode", body)
    assert [w for w, _, _ in early_workers.calls].count("prefill") == 1
    assert _inflight(app) == [0, 0]
    assert 'hybrid_pd_fallbacks_total{reason="prefill_failed"} 1.0' in (await client.get("/metrics")).text


async def test_a_refused_prefill_closes_the_early_leg_and_the_refusal_is_the_answer(early, early_workers):
    client, app = early
    error = {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
    early_workers.prefill_response = httpx.Response(400, json=error)
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 400 and r.json() == error
    assert [w for w, _, _ in early_workers.calls].count("prefill") == 1 and len(early_workers.calls) <= 2  # the early leg at most
    assert _inflight(app) == [0, 0]


async def test_an_early_leg_still_open_when_the_prefill_fails_is_closed(early_workers):
    """The decode worker holds the early leg (its answer not even begun) while the prefill fails: the router stops waiting for it."""
    released, held, closed = asyncio.Event(), asyncio.Event(), []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.host == "decode.test" and HANDOFF_KEY_PARAM.encode() in request.content:
            held.set()
            try:
                await released.wait()  # never set: only the router's cancel ends it
            except asyncio.CancelledError:
                closed.append(True)
                raise
        if request.method == "POST" and request.url.host == "prefill.test":
            await asyncio.wait_for(held.wait(), 5)
            raise httpx.ConnectError("refused")
        return early_workers(request)
    app = router_app(handler)
    async with app.router.lifespan_context(app):
        await probed(app, lambda w: w.identity.handoff is not None)
        async with asgi_client(app) as c:
            r = await asyncio.wait_for(c.post("/v1/completions", json={"model": "m", "prompt": "hi"}), 10)
            assert r.status_code == 200 and closed == [True]
            assert _inflight(app) == [0, 0]


async def test_a_client_that_leaves_during_the_prefill_closes_both_legs(early_workers):
    prefill_started, hold = asyncio.Event(), asyncio.Event()
    cancelled = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            try:
                if request.url.host == "prefill.test":
                    prefill_started.set()
                await hold.wait()
            except asyncio.CancelledError:
                cancelled.append(request.url.host)
                raise
        return early_workers(request)

    app = router_app(handler)
    async with app.router.lifespan_context(app):
        await probed(app, lambda w: w.identity.handoff is not None)
        async with asgi_client(app) as c:
            sent = asyncio.ensure_future(c.post("/v1/completions", json={"model": "m", "prompt": "hi"}))
            await asyncio.wait_for(prefill_started.wait(), 10)
            sent.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sent
            for _ in range(100):
                if len(cancelled) == 2:
                    break
                await asyncio.sleep(0.01)
            assert sorted(cancelled) == ["decode.test", "prefill.test"]
            assert _inflight(app) == [0, 0]


async def test_workers_that_do_not_take_part_get_the_legs_one_after_the_other(client, workers):
    await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert [w for w, _, _ in workers.calls] == ["prefill", "decode"]
    assert HANDOFF_KEY_PARAM not in workers.calls[0][1]["kv_transfer_params"]


async def test_the_router_can_be_told_not_to_send_early_legs(early_workers):
    app = router_app(early_workers, early_decode=False)
    async with app.router.lifespan_context(app):
        await probed(app, lambda w: w.identity.handoff is not None)
        async with asgi_client(app) as c:
            await c.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert [w for w, _, _ in early_workers.calls] == ["prefill", "decode"]
