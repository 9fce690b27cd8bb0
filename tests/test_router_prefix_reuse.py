"""prefix_reuse through the router (scripted workers): each turn of a conversation goes where its prefix can be resumed, and /metrics says so.

The workers report prefix caching on with 128-token state checkpoints in ``vllm:cache_config_info``,
which the router reads when it first probes them (hybrid_pd.router.registry.probe_identity). The
policy's own rules are tested in tests/test_router_policies.py; the real engines' hits in
tests/e2e/test_prefix_caching.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.router_support import KV, asgi_client, router_app

PREFILL = "http://prefill.test:1"
DECODES = ["http://decode-a.test:2", "http://decode-b.test:3"]
CACHE_INFO = 'vllm:cache_config_info{block_size="2048",enable_prefix_caching="%s",mamba_block_size="128"} 1.0\n'


class CachingWorkers:
    """One prefill and two decode workers that record which host got each leg."""

    def __init__(self, caching: bool) -> None:
        self.caching = caching
        self.decoded_on: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
            if request.url.path == "/metrics":
                return httpx.Response(200, text=CACHE_INFO % self.caching)
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "P"}], "usage": usage, "kv_transfer_params": KV})
        self.decoded_on.append(request.url.host)
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        return httpx.Response(200, json={"choices": [{"index": 0, "text": " decoded"}], "usage": usage})


async def _turns(workers: CachingWorkers, prompts: list[list[int]], held: int = 1) -> dict:
    """Send ``prompts`` one after the other through a router with prefix_reuse on both roles; its metrics after.

    After the first prompt, ``held`` legs stay in flight on the first decode worker (streams of
    other clients), so a later request that can resume nothing goes to the other one.
    """
    app = router_app(workers, prefill=[PREFILL], decode=DECODES, decode_policy="prefix_reuse", prefill_policy="prefix_reuse", health_interval_s=0.05)
    state = app.state.router
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        for _ in range(100):  # the health loop admits the workers and probes what they cache
            if all(w.identity.model for w in state.registry.all()):
                break
            await asyncio.sleep(0.02)
        leases = []
        for prompt in prompts:
            answer = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 3})
            assert answer.status_code == 200, answer.text
            leases = leases or [state.registry.lease(state.registry.by_url(DECODES[0]), 0) for _ in range(held)]
        for lease in leases:
            lease.release()
        text = (await client.get("/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _routes(samples: dict, role: str) -> dict[str, float]:
    return {o: samples[("hybrid_pd_prefix_routes_total", (("outcome", o), ("role", role)))] for o in ("hit", "miss", "balanced")}


def _conversation(system: int, turns: int) -> list[list[int]]:
    """Each turn's prompt is the last one plus 60 tokens, after a 300-token system prompt of its own."""
    return [list(range(system, system + 300)) + [7] * (60 * (turn + 1)) for turn in range(turns)]


async def test_each_turn_decodes_where_its_conversation_can_resume():
    workers = CachingWorkers(caching=True)
    a, b = _conversation(1000, 3), _conversation(5000, 3)
    samples = await _turns(workers, [a[0], b[0], a[1], b[1], a[2], b[2]])
    # a's first turn: nothing to resume, both look alike -> decode-a; b's: nothing to resume, decode-a is busier -> decode-b.
    assert workers.decoded_on == ["decode-a.test", "decode-b.test"] * 3
    assert _routes(samples, "decode") == {"hit": 4, "miss": 2, "balanced": 0}
    # Turns 2 and 3 resume the system prompt and the earlier turns, to the last 128-token checkpoint: 256 and 384 tokens.
    assert samples[("hybrid_pd_prefix_reusable_tokens_total", (("role", "decode"),))] == 2 * (256 + 384)
    assert _routes(samples, "prefill") == {"hit": 4, "miss": 2, "balanced": 0}  # one prefill worker, which holds every conversation


async def test_a_shared_system_prompt_stays_on_its_worker_until_it_is_too_busy():
    workers = CachingWorkers(caching=True)
    first, second, third = (_conversation(1000, 1)[0][:300] + [n] * 40 for n in (1, 2, 3))
    await _turns(workers, [first, second], held=4)
    assert workers.decoded_on == ["decode-a.test", "decode-a.test"]  # 4 legs more than decode-b, within the slack: 256 tokens resumed
    workers.decoded_on.clear()
    samples = await _turns(workers, [first, third], held=5)
    assert workers.decoded_on == ["decode-a.test", "decode-b.test"]  # 5 more: the idle worker prefills the system prompt again
    assert _routes(samples, "decode") == {"hit": 0, "miss": 1, "balanced": 1}


async def test_without_prefix_caching_it_routes_by_load_alone():
    workers = CachingWorkers(caching=False)
    a = _conversation(1000, 3)
    samples = await _turns(workers, a)
    assert workers.decoded_on == ["decode-a.test", "decode-b.test", "decode-b.test"]
    assert _routes(samples, "decode") == {"hit": 0, "miss": 3, "balanced": 0}
    assert samples[("hybrid_pd_prefix_reusable_tokens_total", (("role", "decode"),))] == 0
