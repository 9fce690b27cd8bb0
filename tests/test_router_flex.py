"""Flexible workers through the router: served whole as replicas, split by phase when TTFT breaks its target (scripted workers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import httpx

from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.router.state import RouterState
from tests.router_support import KV, asgi_client, router_app

FLEX_A, FLEX_B = "http://flex-a.test:1", "http://flex-b.test:2"


class FlexWorkers:
    """Two scripted kv_both workers: a prefill leg gets state to pull, any other request a decoded answer."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        self.calls.append((request.url.host, body))
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "P"}], "usage": usage, "kv_transfer_params": KV})
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        return httpx.Response(200, json={"choices": [{"index": 0, "text": " decoded"}], "usage": usage})


def _counter(text: str, name: str, reason: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f'{name}{{reason="{reason}"}}'))
    return float(line.rsplit(" ", 1)[1])


@contextlib.asynccontextmanager
async def _router(workers: FlexWorkers, **settings: object) -> AsyncIterator[tuple[httpx.AsyncClient, RouterState]]:
    """A running router in front of the two flex workers, both admitted; its client and state."""
    app = router_app(workers, prefill=[], decode=[], flex=[FLEX_A, FLEX_B], **settings)
    state = app.state.router
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        for worker in state.registry.all():
            state.registry.record_health(worker, ok=True)
        yield client, state


async def test_flexible_workers_serve_whole_requests_as_replicas():
    workers = FlexWorkers()
    async with _router(workers, slo_ttft_ms=500.0, slo_tpot_ms=20.0) as (client, _):
        body = {"model": "m", "prompt": "x" * 4000, "max_tokens": 3}
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(4)))
        assert [(r.status_code, r.json()["choices"][0]["text"]) for r in answers] == [(200, " decoded")] * 4
        metrics = (await client.get("/metrics")).text
    assert not [b for _, b in workers.calls if "kv_transfer_params" in b]  # no leg of either kind: colocated requests
    assert {host for host, _ in workers.calls} == {"flex-a.test", "flex-b.test"}  # both serve at once, as replicas
    assert _counter(metrics, "hybrid_pd_fallbacks_total", "replica") == 4
    assert _counter(metrics, "hybrid_pd_disaggregated_total", "phase_split") == 0
    assert "hybrid_pd_phase_split 0.0" in metrics


async def test_split_by_phase_one_flex_worker_prefills_and_the_other_pulls_the_state():
    workers = FlexWorkers()
    async with _router(workers, slo_ttft_ms=500.0, slo_tpot_ms=20.0) as (client, state):
        a, b = state.registry.role("flex")
        held = [state.registry.lease(a, 10) for _ in range(4)] + [state.registry.lease(b, 10) for _ in range(2)]
        now = time.perf_counter()
        a.load.chunk_gap(0.008, now)  # both stream at 8 ms per token: room under 20 ms
        b.load.chunk_gap(0.008, now)
        for _ in range(state.settings.split_policy.window):
            state.pairing.split.observe_ttft(time.perf_counter(), 0.9)  # the last requests' first tokens came 900 ms after they arrived
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 4000, "max_tokens": 3})
        metrics = (await client.get("/metrics")).text
        for lease in held:
            lease.release()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " decoded"
    (prefill_host, prefill), (decode_host, decode) = workers.calls
    assert (prefill_host, decode_host) == ("flex-b.test", "flex-a.test")  # B, decoding fewer, prefills; A decodes
    assert prefill["kv_transfer_params"]["do_remote_decode"] and decode["kv_transfer_params"]["remote_engine_id"] == KV["remote_engine_id"]
    assert r.json()["usage"]["prompt_tokens"] == 5 and _counter(metrics, "hybrid_pd_disaggregated_total", "phase_split") == 1
    assert "hybrid_pd_phase_split 1.0" in metrics
    assert (a.load.decodes, b.load.decodes) == (0, 0)


def test_flex_urls_are_checked_like_the_others():
    assert RouterSettings(flex=["http://f:1/"]).flex == ["http://f:1"]
