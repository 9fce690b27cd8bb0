"""The router's Prometheus metrics (``GET /metrics``), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["RouterMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class RouterMetrics:
    """Counters and histograms an on-call engineer reads first."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hybrid_pd_requests", "Requests by route and outcome", ["route", "outcome"], registry=r)
        self.ttft = Histogram("hybrid_pd_ttft_seconds", "Router arrival to first byte to the client", buckets=_LATENCY, registry=r)
        self.itl = Histogram("hybrid_pd_itl_seconds", "Time between streamed chunks", buckets=_FAST, registry=r)
        self.e2e = Histogram("hybrid_pd_e2e_seconds", "Router arrival to the last byte", buckets=_LATENCY, registry=r)
        self.prefill_leg = Histogram("hybrid_pd_prefill_leg_seconds", "Prefill leg duration", buckets=_LATENCY, registry=r)
        self.decode_leg = Histogram("hybrid_pd_decode_leg_seconds", "Decode leg, request to last byte", buckets=_LATENCY, registry=r)
        self.overhead = Histogram(
            "hybrid_pd_router_overhead_seconds", "Router time outside both legs until the decode leg is sent", buckets=_FAST, registry=r
        )
        self.inflight = Gauge("hybrid_pd_worker_inflight", "In-flight legs per worker", ["role", "url"], registry=r)
        self.fallbacks = Counter("hybrid_pd_fallbacks", "Requests served by the decode worker alone", ["reason"], registry=r)
        self.retries = Counter("hybrid_pd_retries", "Decode legs retried on another worker", registry=r)
        self.migrations = Counter(
            "hybrid_pd_migrations", "Streams carried to another decode worker after theirs broke or stalled", ["outcome"], registry=r
        )
        self.evictions = Gauge("hybrid_pd_evictions", "Workers evicted after failed health checks (total)", registry=r)
        self.rejected = Counter("hybrid_pd_rejected", "Requests refused before routing", ["status"], registry=r)
