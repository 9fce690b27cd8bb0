"""What an autoscaler reads from the router: how much prefill work waits and how full and how fast decoding is.

P/D pools scale apart (the sizing issue: a 1000/64 workload is prefill-bound, a 1000/512 one
leaves the prefill GPU idle), so each pool gets its own signal, computed from the registry when
``/metrics`` is scraped, never per request:

- ``hybrid_pd_prefill_queue_tokens``: prompt tokens of the prefill legs in flight. Divided by one
  prefill worker's throughput (``hybrid-pd size``'s profile: tokens per second) it is the seconds
  of prefill queued, which the TTFT target bounds.
- ``hybrid_pd_decode_occupancy``: decode legs in flight over what the available decode-capable
  workers take (their count times ``--max-concurrency-per-worker``), 0 to 1.
- ``hybrid_pd_decode_tpot_seconds``: the mean of the decode-capable workers' live TPOT
  (:mod:`hybrid_pd.router.load`), NaN while none streams; the TPOT target bounds it.

docs/sizing.md has the KEDA and HPA rules that use them.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Gauge

from hybrid_pd.router.registry import DECODERS, Registry

__all__ = ["register_signals"]


def register_signals(metrics: CollectorRegistry, registry: Registry, per_worker_limit: int) -> None:
    """Add the three gauges to ``metrics``, each read from ``registry`` at scrape time."""

    def queued() -> float:
        return float(sum(w.load.prefill_tokens for w in registry.all()))

    def occupancy() -> float:
        decoders = [w for w in registry.role(*DECODERS) if w.available]
        return sum(w.load.decodes for w in decoders) / (len(decoders) * per_worker_limit) if decoders else 0.0

    def tpot() -> float:
        live = [t for t in (w.load.view().tpot_s for w in registry.role(*DECODERS) if w.available) if t is not None]
        return sum(live) / len(live) if live else math.nan

    Gauge("hybrid_pd_prefill_queue_tokens", "Prompt tokens of the prefill legs in flight (autoscaling: hybrid_pd/router/autoscale.py)", registry=metrics).set_function(queued)
    Gauge("hybrid_pd_decode_occupancy", "Decode legs in flight over what the available decode-capable workers take (0-1)", registry=metrics).set_function(occupancy)
    Gauge("hybrid_pd_decode_tpot_seconds", "Mean live time per output token of the decode-capable workers; NaN while none streams", registry=metrics).set_function(tpot)
