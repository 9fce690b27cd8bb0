"""The planner's live side: every few seconds, the layout of the flexible workers for the traffic now, and their roles.

The decision is :func:`hybrid_pd.sizing.planner.decide` (pure: the traffic the router measured,
:mod:`hybrid_pd.sizing.traffic`, the model's profile, the SLOs), run in a process of its own so
that its simulations never hold the router's event loop. Its answer becomes each flexible
worker's role (:func:`hybrid_pd.sizing.planner.assign`: as few moves as it takes), which
:mod:`hybrid_pd.router.pairing` reads per request. No worker restarts: a worker that turns to
prefilling keeps decoding the requests it holds, and the requests already routed finish where
they are, so no request is lost while roles move.

Several routers in front of the same workers agree by having one decide: a router started with
``--planner-leader URL`` decides nothing and takes the roles that router serves at ``GET
/planner`` (by worker URL), every period. Layout, predictions and every move are on
``/metrics`` (``hybrid_pd_planner_*``) and in the log.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from hybrid_pd.common.logs import kv
from hybrid_pd.router.metrics import RouterMetrics
from hybrid_pd.router.pairing import Pairing
from hybrid_pd.router.registry import Registry
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.sizing.traffic import TrafficWindow
from hybrid_pd.router.upstream import Upstream
from hybrid_pd.sizing.layouts import Layout
from hybrid_pd.sizing.planner import ROLES, Decision, Role, assign, decide
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.simulate import SLO

__all__ = ["Planner", "layout_of"]

log = logging.getLogger("hybrid_pd.router")


def layout_of(roles: dict[str, Role], workers: list[str]) -> Layout:
    """The layout the ``workers`` (URLs) run under ``roles``: xPyD while some prefill and some decode, else all whole."""
    prefill = sum(1 for w in workers if roles.get(w) == "prefill")
    return Layout("pd", prefill, len(workers) - prefill) if 0 < prefill < len(workers) else Layout("flex", 0, len(workers))


@dataclass
class Planner:
    """The roles of one router's flexible workers, decided here or taken from a leader router."""

    settings: RouterSettings
    registry: Registry
    pairing: Pairing
    metrics: RouterMetrics
    traffic: TrafficWindow
    profile: Profile | None = None
    decision: Decision | None = None
    moves: int = 0

    @property
    def leads(self) -> bool:
        return self.profile is not None and self.settings.planner_leader is None

    def flex(self) -> list[str]:
        """The available flexible workers' URLs, in registration order: the workers the planner lays out."""
        return [w.url for w in self.registry.role("flex") if w.available]

    async def run(self, upstream: Upstream) -> None:
        """Look every ``planner_interval_s``: decide (the leader) or follow, until cancelled."""
        interval = self.settings.planner_interval_s
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) if self.leads else None
        try:
            while True:
                await asyncio.sleep(interval)
                try:
                    if pool is not None:
                        await self._decide(pool)
                    else:
                        await self._follow(upstream)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a failed look leaves the roles as they are; the next one tries again
                    log.warning("planner look failed; roles unchanged %s", kv(error=f"{type(exc).__name__}: {exc}"))
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    async def _decide(self, pool: ProcessPoolExecutor) -> None:
        workers = self.flex()
        traffic = self.traffic.summary(time.perf_counter())
        if len(workers) < 2 or traffic is None or traffic.requests < 2 * len(workers):
            return
        s = self.settings
        assert self.profile is not None and s.slo_ttft_ms is not None and s.slo_tpot_ms is not None
        current = layout_of(self.pairing.roles, workers)
        slo = SLO(s.slo_ttft_ms, s.slo_tpot_ms)
        loop = asyncio.get_running_loop()
        decision = await loop.run_in_executor(pool, decide, self.profile, traffic, slo, len(workers), current, s.planner_margin)
        self.decision = decision
        for p in decision.predictions:
            self.metrics.planner_predicted.labels(str(p.prefill)).set(p.goodput_per_gpu)
        if decision.moves and workers == self.flex():  # the workers did not change while it simulated
            decodes = {w.url: w.load.decodes for w in self.registry.role("flex")}
            self.apply(assign(decision.layout, workers, self.pairing.roles, decodes), decision.why)

    async def _follow(self, upstream: Upstream) -> None:
        leader = self.settings.planner_leader
        assert leader is not None
        try:
            answer = await upstream.request("GET", leader.rstrip("/") + "/planner")
            roles = answer.json()["roles"] if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            log.warning("planner leader unreachable; roles unchanged %s", kv(leader=leader, error=type(exc).__name__))
            return
        if isinstance(roles, dict) and roles != self.pairing.roles:
            self.apply({str(url): role for url, role in roles.items() if role in ROLES}, f"from the leader {leader}")

    def apply(self, roles: dict[str, Role], why: str) -> None:
        """Give the flexible workers ``roles`` (by URL; a worker not named serves whole requests); counted and logged."""
        before = layout_of(self.pairing.roles, self.flex())
        self.pairing.roles = dict(roles)
        after = layout_of(roles, self.flex())
        self.moves += 1
        self.metrics.planner_moves.inc()
        self.metrics.planner_prefillers.set(after.prefill)
        log.info("planner roles %s", kv(before=before.name, after=after.name, roles=roles, why=why))

    def snapshot(self) -> dict[str, Any]:
        """What ``GET /planner`` shows: the roles by worker URL, the layout, and the last decision's predictions."""
        workers = self.flex()
        out: dict[str, Any] = {
            "leads": self.leads,
            "leader": self.settings.planner_leader,
            "layout": layout_of(self.pairing.roles, workers).name,
            "roles": {w: self.pairing.roles.get(w, "whole") for w in workers},
            "moves": self.moves,
        }
        if self.decision is not None:
            out["why"] = self.decision.why
            out["predictions"] = [
                {"layout": p.layout, "goodput_per_gpu": p.goodput_per_gpu, "throughput_rps": p.throughput_rps} for p in self.decision.predictions
            ]
        return out

