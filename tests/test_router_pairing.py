"""The pairing pipeline (filters -> decider -> policy), flexible workers in it, and the leases that count legs in flight."""

from __future__ import annotations

import time

import pytest

from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.connector.compat import WorkerIdentity
from hybrid_pd.router.decider import Slo
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


def _pairing(registry: Registry, below_tokens: int = 0, limit: int = 2, slo: Slo = Slo()) -> Pairing:
    return Pairing(registry, LeastOutstanding(), LeastOutstanding(), slo, below_tokens, limit)


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


def test_flexible_workers_decode_and_prefill_for_each_other_but_never_for_themselves():
    registry = _registry(("http://f1", "flex"), ("http://f2", "flex"), ("http://p", "prefill"), ("http://d", "decode"))
    f1, f2 = registry.role("flex")
    pairing = _pairing(registry, limit=8)
    # Any worker that can decode is a decode candidate; the least loaded wins.
    registry.role("decode")[0].inflight = f1.inflight = 1
    assert pairing.decode(LONG, tried=()) is f2
    # A dedicated decode worker takes its prompts from any prefiller: the prefill worker or a flex one.
    assert pairing.prefill(registry.role("decode")[0], LONG).worker in (f1, f2, registry.role("prefill")[0])
    # Without a TPOT target a flex worker serves as a replica: it prefills for itself.
    assert pairing.prefill(f2, LONG) == PrefillChoice(None, "decode_headroom")


def test_a_flexible_worker_under_tpot_pressure_hands_its_prefill_to_a_worker_decoding_less():
    registry = _registry(("http://f1", "flex"), ("http://f2", "flex"))
    f1, f2 = registry.role("flex")
    pairing = _pairing(registry, limit=8, slo=Slo(tpot_s=0.020, split_above=0.5))
    for _ in range(3):
        registry.lease(f1, 100)  # three decodes on f1
    f1.load.chunk_gap(0.015, now=time.perf_counter())  # its streams at 15 ms per token: past half the 20 ms target
    assert pairing.prefill(f1, LONG) == PrefillChoice(f2, "decode_pressure")
    for _ in range(3):
        registry.lease(f2, 100)  # f2 decodes as many: moving the prefill there helps nobody
    assert pairing.prefill(f1, LONG) == PrefillChoice(None, "decode_headroom")


def test_a_lease_counts_decodes_and_the_prefill_queue_and_times_the_prefill_rate():
    registry = Registry()
    worker = registry.add(Worker(url="http://f", role="flex", identity=WorkerIdentity(role="flex")))
    prefill = registry.lease(worker, 300, "prefill")
    local = registry.lease(worker, 100, "local")
    decode = registry.lease(worker, 50, "decode")
    assert (worker.load.decodes, worker.load.prefill_tokens) == (2, 400)
    time.sleep(0.01)
    prefill.prefilled()  # 300 tokens, nothing ahead of them, in >= 10 ms
    assert worker.load.prefill_tokens == 100 and 0 < worker.load.prefill_rate.value <= 300 / 0.01
    local.release()  # ended before its first byte: out of the queue, no rate sample
    decode.release()
    prefill.release()
    assert (worker.load.decodes, worker.load.prefill_tokens, worker.inflight) == (0, 0, 0)
    assert worker.load.view().prefill_wait_s(1000) == pytest.approx(1000 / worker.load.prefill_rate.value)
