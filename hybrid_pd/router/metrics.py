"""The router's Prometheus metrics (``GET /metrics``), one registry per app.

Every counter has a series for each label value the router can give it from the start, at
zero: a dashboard or an alert on a rate sees 0, not "no data", before the first event.
The label values are declared here, once (the route and outcome of a request, why a
request had no prefill leg, how a migration went, which refusals the router answers);
``tests/test_router_metrics.py`` checks them against the code that counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hybrid_pd.router.decider import LOCAL_REASONS, SPLIT_REASONS
from hybrid_pd.router.inbox_reach import PUSH_PATHS
from hybrid_pd.router.policies import PREFIX_OUTCOMES

__all__ = ["MIGRATION_OUTCOMES", "OUTCOMES", "REFUSALS", "ROUTES", "Outcome", "Route", "RouterMetrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)

# A request's ``route`` label: the two generation paths, then vLLM's model-level paths the router forwards.
Route = Literal["completions", "chat", "models", "tokenize", "detokenize", "tokenizer_info", "version"]
ROUTES: tuple[Route, ...] = get_args(Route)
GENERATION: tuple[Route, ...] = ("completions", "chat")
# How a request that reached a worker ended; a worker's own error answer, passed on as it came,
# is ``http_<status>`` besides these.
Outcome = Literal["ok", "stream_error", "client_disconnected"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
MIGRATION_OUTCOMES = ("ok", "failed")
# The statuses of the router's own error answers (hybrid_pd/router/*.py raise OpenAIError with them).
REFUSALS = (400, 401, 404, 409, 413, 429, 502, 503)


class RouterMetrics:
    """Counters and histograms an on-call engineer reads first."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hybrid_pd_requests",
            "Requests that reached a worker, by route and outcome (ok, stream_error, client_disconnected, http_<status> of a worker's error answer)",
            ["route", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "hybrid_pd_ttft_seconds",
            "Streamed generation requests only: router arrival to the first chunk sent to the client "
            "(a whole answer's first byte is its last: hybrid_pd_e2e_seconds)",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram("hybrid_pd_itl_seconds", "Time between streamed chunks", buckets=_FAST, registry=r)
        self.e2e = Histogram(
            "hybrid_pd_e2e_seconds", "Generation requests, streamed or not: router arrival to the last byte", buckets=_LATENCY, registry=r
        )
        self.prefill_leg = Histogram("hybrid_pd_prefill_leg_seconds", "Prefill leg duration", buckets=_LATENCY, registry=r)
        self.decode_leg = Histogram(
            "hybrid_pd_decode_leg_seconds",
            "Decode leg, streamed or not: sent to its answer's last byte (one per choice)",
            buckets=_LATENCY,
            registry=r,
        )
        self.overhead = Histogram(
            "hybrid_pd_router_overhead_seconds", "Router time outside both legs until the decode leg is sent", buckets=_FAST, registry=r
        )
        self.inflight = Gauge("hybrid_pd_worker_inflight", "In-flight legs per worker", ["role", "url"], registry=r)
        self.fallbacks = Counter(
            "hybrid_pd_fallbacks", "Requests prefilled on their decode worker, by why (hybrid_pd/router/decider.py)", ["reason"], registry=r
        )
        self.disaggregated = Counter(
            "hybrid_pd_disaggregated", "Requests prefilled on another worker and pulled, by why (hybrid_pd/router/decider.py)", ["reason"], registry=r
        )
        self.planner_prefillers = Gauge(
            "hybrid_pd_planner_prefill_workers",
            "Flexible workers the planner has prefilling for the others now (0: every one serves whole requests; hybrid_pd/router/planner.py)",
            registry=r,
        )
        self.planner_predicted = Gauge(
            "hybrid_pd_planner_predicted_goodput_per_gpu",
            "The planner's last prediction of each layout's goodput per GPU, by its prefilling workers (0: every one serves whole requests)",
            ["prefill_workers"],
            registry=r,
        )
        self.planner_moves = Counter("hybrid_pd_planner_moves", "Times the planner gave the flexible workers new roles", registry=r)
        self.prefix_routes = Counter(
            "hybrid_pd_prefix_routes",
            "prefix_reuse choices, by role and outcome: hit (the worker that can resume most), miss (none can), balanced (the best was too busy)",
            ["role", "outcome"],
            registry=r,
        )
        self.prefix_reusable = Counter(
            "hybrid_pd_prefix_reusable_tokens",
            "Prompt tokens the chosen worker is expected to resume from a state checkpoint (prefix_reuse), by role",
            ["role"],
            registry=r,
        )
        self.retries = Counter("hybrid_pd_retries", "Decode legs retried on another worker", registry=r)
        self.early_legs = Counter(
            "hybrid_pd_early_legs",
            "Decode legs sent with their prefill leg, by where the prefill pushes the state's whereabouts: server (the decode "
            "worker's, which holds the leg or relays to its engine), inbox (its engine's, the prefill said it reaches it: "
            "hybrid_pd/router/inbox_reach.py)",
            ["push"],
            registry=r,
        )
        self.migrations = Counter(
            "hybrid_pd_migrations", "Streams carried to another decode worker after theirs broke or stalled", ["outcome"], registry=r
        )
        self.evictions = Gauge("hybrid_pd_evictions", "Workers evicted after failed health checks (total)", registry=r)
        self.rejected = Counter(
            "hybrid_pd_rejected", "Requests answered with the router's own error (refused, or no worker could answer), by status", ["status"], registry=r
        )
        for route in ROUTES:
            for outcome in OUTCOMES if route in GENERATION else ("ok", "client_disconnected"):
                self.requests.labels(route, outcome)
        for reason in LOCAL_REASONS:
            self.fallbacks.labels(reason)
        for reason in SPLIT_REASONS:
            self.disaggregated.labels(reason)
        for push in PUSH_PATHS:
            self.early_legs.labels(push)
        for role in ("prefill", "decode"):
            self.prefix_reusable.labels(role)
            for outcome in PREFIX_OUTCOMES:
                self.prefix_routes.labels(role, outcome)
        self.planner_predicted.labels("0")
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome)
        for status in REFUSALS:
            self.rejected.labels(str(status))

    def prefix_reporter(self, role: str) -> Callable[[str, int], None]:
        """What ``prefix_reuse`` picking for ``role`` tells: each choice's outcome and expected reusable tokens."""
        routes, reusable = {o: self.prefix_routes.labels(role, o) for o in PREFIX_OUTCOMES}, self.prefix_reusable.labels(role)

        def report(outcome: str, tokens: int) -> None:
            routes[outcome].inc()
            reusable.inc(tokens)

        return report

    def finished(self, route: Route, outcome: str, arrived: float) -> None:
        """Count a request that reached a worker; a generation request's time from ``arrived`` (perf_counter) to now."""
        self.requests.labels(route, outcome).inc()
        if route in GENERATION:
            self.e2e.observe(time.perf_counter() - arrived)
