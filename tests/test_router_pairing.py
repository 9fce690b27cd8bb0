"""The pairing pipeline (filters -> decider -> policy), flexible workers in it, and the leases that count legs in flight."""

from __future__ import annotations

import pytest

from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.connector.compat import WorkerIdentity
from hybrid_pd.router.metrics import RouterMetrics
from hybrid_pd.router.pairing import Pairing, PrefillChoice
from hybrid_pd.router.policies import LeastOutstanding, RequestInfo
from hybrid_pd.router.registry import Registry, Worker

LONG = RequestInfo(est_tokens=100)


def _registry(*workers: tuple[str, str], **identity: object) -> Registry:
    registry = Registry(eviction_failures=1)
    for url, role in workers:
        registry.add(Worker(url=url, role=role, identity=WorkerIdentity(role=role, model="m", **identity), healthy=True))
    return registry


def _pairing(registry: Registry, below_tokens: int = 0, limit: int = 2) -> Pairing:
    return Pairing(registry, LeastOutstanding(), LeastOutstanding(), below_tokens, limit, prompt_tokens=lambda tokens, exact: tokens)


def test_the_decode_worker_is_an_available_untried_one_under_its_limit():
    registry = _registry(("http://d1", "decode"), ("http://d2", "decode"), ("http://d3", "decode"))
    d1, d2, d3 = registry.role("decode")
    d1.draining, d2.inflight = True, 2
    pairing = _pairing(registry)
    assert pairing.decode(LONG, tried=()) is d3
    with pytest.raises(OpenAIError) as full:
        pairing.decode(LONG, tried={d3.id})
    assert (full.value.status, full.value.message) == (429, "every decode worker is at its concurrency limit")
    registry.record_health(d2, ok=False)  # evicted
    with pytest.raises(OpenAIError) as none:
        pairing.decode(LONG, tried={d3.id})
    assert (none.value.status, none.value.message) == (503, "no decode worker is available")
    assert pairing.decode_available() and not pairing.decode_available(tried={d3.id})


def test_the_prefill_worker_is_compatible_with_the_decode_worker_and_under_its_limit():
    registry = _registry(("http://d", "decode"), ("http://p1", "prefill"), ("http://p2", "prefill"))
    decode, (p1, p2) = registry.role("decode")[0], registry.role("prefill")
    p1.inflight = 2
    pairing = _pairing(registry)
    assert pairing.prefill(decode, LONG) == PrefillChoice(p2, "disaggregated")
    p2.identity = WorkerIdentity(role="prefill", model="another")
    assert pairing.prefill(decode, LONG) == PrefillChoice(None, "no_prefill_worker")


def test_the_decider_keeps_short_prompts_on_the_decode_worker():
    registry = _registry(("http://d", "decode"), ("http://p", "prefill"))
    pairing = _pairing(registry, below_tokens=100)
    decode, prefill = registry.role("decode")[0], registry.role("prefill")[0]
    assert pairing.prefill(decode, RequestInfo(est_tokens=99)) == PrefillChoice(None, "short_prompt")
    assert pairing.prefill(decode, RequestInfo(est_tokens=100)) == PrefillChoice(prefill, "disaggregated")


def test_a_lease_counts_a_leg_until_released_once_however_often_release_is_called():
    metrics = RouterMetrics()
    registry = Registry(inflight_gauge=metrics.inflight)
    worker = registry.add(Worker(url="http://d", role="decode", identity=WorkerIdentity(role="decode")))
    gauge = metrics.inflight.labels("decode", "http://d")
    first, second = registry.lease(worker, 10), registry.lease(worker, 5)
    assert (worker.inflight, worker.inflight_tokens, gauge._value.get()) == (2, 15, 2)
    first.release()
    first.release()
    assert (worker.inflight, worker.inflight_tokens, gauge._value.get()) == (1, 5, 1)
    second.release()
    assert (worker.inflight, worker.inflight_tokens, gauge._value.get()) == (0, 0, 0)


def test_a_lease_held_by_a_block_is_released_when_it_raises_and_not_again_after():
    registry = Registry()
    worker = registry.add(Worker(url="http://p", role="prefill", identity=WorkerIdentity(role="prefill")))
    with pytest.raises(RuntimeError), registry.lease(worker, 7) as lease:
        assert worker.inflight == 1
        raise RuntimeError("the leg failed")
    lease.release()
    assert (worker.inflight, worker.inflight_tokens) == (0, 0)


def test_flexible_workers_serve_whole_requests_and_prefill_for_dedicated_decoders():
    registry = _registry(("http://f1", "flex"), ("http://f2", "flex"), ("http://p", "prefill"), ("http://d", "decode"))
    f1, f2 = registry.role("flex")
    decode, prefill = registry.role("decode")[0], registry.role("prefill")[0]
    pairing = _pairing(registry, limit=8)
    decode.inflight = f1.inflight = 1
    assert pairing.decode(LONG, tried=()) is f2  # any worker that can decode; the least loaded
    assert pairing.prefill(decode, LONG).worker in (f1, f2, prefill)  # a dedicated decoder: any prefiller
    assert pairing.prefill(f2, LONG) == PrefillChoice(None, "replica")  # no split: a flex worker serves it whole


def test_the_planners_roles_prefillers_prefill_for_the_decoders_and_decode_nothing_new():
    registry = _registry(("http://f1", "flex"), ("http://f2", "flex"), ("http://f3", "flex"))
    f1, f2, f3 = registry.role("flex")
    pairing = _pairing(registry, limit=8)
    held = [registry.lease(f1, 100) for _ in range(3)] + [registry.lease(f3, 100) for _ in range(2)]
    pairing.roles = {"http://f1": "decode", "http://f2": "prefill", "http://f3": "decode"}
    assert pairing.decode(LONG, tried=()) is f3  # f2, the idlest, prefills: the least loaded decoder is f3
    assert pairing.prefill(f3, LONG) == PrefillChoice(f2, "planner")
    pairing.roles = {"http://f1": "decode", "http://f2": "prefill", "http://f3": "whole"}  # a worker with no split serves whole
    assert pairing.prefill(f3, LONG) == PrefillChoice(None, "replica")
    registry.record_health(f1, ok=False)
    registry.record_health(f3, ok=False)  # every decoder gone: the prefiller decodes too, whole
    assert pairing.decode(LONG, tried=()) is f2 and pairing.prefill(f2, LONG) == PrefillChoice(None, "no_prefill_worker")
    for lease in held:
        lease.release()


def test_a_prefill_lease_is_no_decode():
    registry = Registry()
    worker = registry.add(Worker(url="http://f", role="flex", identity=WorkerIdentity(role="flex")))
    prefill, decode = registry.lease(worker, 300, "prefill"), registry.lease(worker, 50)
    assert (worker.inflight, worker.load.decodes) == (2, 1)
    decode.release()
    decode.release()
    prefill.release()
    assert (worker.inflight, worker.load.decodes, worker.inflight_tokens) == (0, 0, 0)
