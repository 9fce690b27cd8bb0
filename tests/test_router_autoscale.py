"""The autoscaling signals on /metrics follow the legs in flight (scripted workers; hybrid_pd/router/autoscale.py)."""

from __future__ import annotations

import math
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.router_support import DECODE, PREFILL, Workers, asgi_client, router_app


def _gauges(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("hybrid_pd_") and not s.labels}


async def test_prefill_queue_decode_occupancy_and_tpot_follow_the_legs_in_flight():
    app = router_app(Workers(), max_concurrency_per_worker=4)
    state = app.state.router
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        prefill, decode = state.registry.by_url(PREFILL), state.registry.by_url(DECODE)
        for worker in (prefill, decode):
            state.registry.record_health(worker, ok=True)
        idle = _gauges((await client.get("/metrics")).text)
        assert idle["hybrid_pd_prefill_queue_tokens"] == 0 and idle["hybrid_pd_decode_occupancy"] == 0
        assert math.isnan(idle["hybrid_pd_decode_tpot_seconds"])
        legs = [state.registry.lease(prefill, 1000, "prefill"), state.registry.lease(prefill, 3000, "prefill")]
        legs += [state.registry.lease(decode, 1000, "decode") for _ in range(3)]
        decode.load.chunk_gap(0.012, now=time.perf_counter())
        busy = _gauges((await client.get("/metrics")).text)
        assert busy["hybrid_pd_prefill_queue_tokens"] == 4000  # the decode legs' prompt tokens are not queued prefill
        assert busy["hybrid_pd_decode_occupancy"] == 3 / 4
        assert busy["hybrid_pd_decode_tpot_seconds"] == 0.012
        for leg in legs:
            leg.release()
        after = _gauges((await client.get("/metrics")).text)
        assert after["hybrid_pd_prefill_queue_tokens"] == 0 and after["hybrid_pd_decode_occupancy"] == 0
