"""The planner's live side: every few seconds, the layout of the flexible workers for the traffic now, and their roles.

The decision is :func:`hybrid_pd.sizing.planner.decide` (pure: the traffic the router measured,
:mod:`hybrid_pd.sizing.traffic`, the model's profile, the SLOs), run in a process of its own so
that its simulations never hold the router's event loop. Its answer becomes each flexible
worker's role (:func:`hybrid_pd.sizing.planner.assign`: as few moves as it takes), which
:mod:`hybrid_pd.router.pairing` reads per request. No worker restarts: a worker that turns to
prefilling keeps decoding the requests it holds, and the requests already routed finish where
they are, so no request is lost while roles move.

Several routers in front of the same workers (``--planner-peer``: each router's URL, or one name
that resolves to all of them, a headless Service) agree by having one decide: every period each
asks its peers for ``GET /planner/peer`` (:meth:`Planner.peer`: an id that orders routers by when
they started, whether it has a profile, its roles and its traffic window). Of the routers with a
profile, the one up longest leads: it decides for the traffic of all (their windows merged,
:meth:`hybrid_pd.sizing.traffic.TrafficWindow.merged`), the others take its roles. A restarted
router does not take the lead from one that runs; a leader that stops answering is replaced by the
next within a period; a router that reaches no leader keeps its roles (any roles serve every
request correctly; only the goodput differs). Layout, predictions and every move are on
``/metrics`` (``hybrid_pd_planner_*``) and in the log.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import socket
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from hybrid_pd.common.logs import kv
from hybrid_pd.router.metrics import RouterMetrics
from hybrid_pd.router.pairing import Pairing
from hybrid_pd.router.peer_wire import bounds_json, bounds_of, window_json, window_of
from hybrid_pd.router.registry import Registry
from hybrid_pd.router.request_slo import router_slo
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.sizing.traffic import TrafficWindow
from hybrid_pd.router.upstream import Upstream
from hybrid_pd.sizing.layouts import Layout
from hybrid_pd.sizing.planner import ROLES, Decision, Role, Traffic, assign, decide
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.workload import Lengths

__all__ = ["PEER_PATH", "Planner", "layout_of"]

PEER_PATH = "/planner/peer"  # what a router shares with its peers (Planner.peer)

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
    leader: str | None = None  # the leading router's id, once peers answered
    # Orders routers by when they started (wall clock, fixed width), then at random: the one up longest leads.
    id: str = field(default_factory=lambda: f"{time.time():017.6f}-{uuid.uuid4().hex[:8]}")

    @property
    def decides(self) -> bool:
        """Whether this router can decide (it has the model's profile): it does unless a peer up longer can too."""
        return self.profile is not None

    @property
    def looks(self) -> bool:
        """Whether the planner runs at all: it decides, or it has peers to follow."""
        return self.decides or bool(self.settings.planner_peers)

    def flex(self) -> list[str]:
        """The available flexible workers' URLs, in registration order: the workers the planner lays out."""
        return [w.url for w in self.registry.role("flex") if w.available]

    async def run(self, upstream: Upstream) -> None:
        """Look every ``planner_interval_s``: decide (the leader) or follow, until cancelled."""
        interval = self.settings.planner_interval_s
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) if self.decides else None
        try:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self._look(upstream, pool)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a failed look leaves the roles as they are; the next one tries again
                    log.warning("planner look failed; roles unchanged %s", kv(error=f"{type(exc).__name__}: {exc}"))
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    async def _look(self, upstream: Upstream, pool: ProcessPoolExecutor | None) -> None:
        """One period: the peers' state, then decide (this router leads) or take the leader's roles."""
        now = time.perf_counter()
        peers = [p for p in await self._peers(upstream) if p.get("id") != self.id]
        deciding = [p for p in peers if p.get("decides")]
        if self.decides and all(self.id < p["id"] for p in deciding):
            self.leader = self.id
            if pool is not None:
                views = [self.traffic.view(now)] + [v for v in (window_of(p.get("window")) for p in peers) if v is not None]
                window = TrafficWindow.merged(views, self.traffic.seconds, self.traffic.recent_s, now) if len(views) > 1 else self.traffic
                await self._decide(pool, window.summary(now))
            return
        if not deciding:
            return
        leader = min(deciding, key=lambda p: p["id"])
        self.leader = leader["id"]
        roles, bounds = leader.get("roles"), bounds_of(leader.get("split_prompts"))  # a peer's word, read once here
        if isinstance(roles, dict) and roles != self.pairing.roles:
            self.apply({str(url): role for url, role in roles.items() if role in ROLES}, f"from the leader {leader['id']}", bounds)
        else:
            self.pairing.split_prompts = bounds

    async def _peers(self, upstream: Upstream) -> list[dict[str, Any]]:
        """What every peer router that answers shares (:meth:`peer`); each name of ``--planner-peer`` asked at every address."""
        urls = [u for peer in self.settings.planner_peers for u in await _addresses(peer)]

        async def ask(url: str) -> dict[str, Any] | None:
            try:
                answer = await upstream.request("GET", url + PEER_PATH, timeout=min(2.0, self.settings.planner_interval_s))
                body = answer.json() if answer.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as exc:
                log.debug("planner peer did not answer %s", kv(peer=url, error=type(exc).__name__))
                return None
            return body if isinstance(body, dict) and isinstance(body.get("id"), str) else None

        return [body for body in await asyncio.gather(*(ask(u) for u in dict.fromkeys(urls))) if body is not None]

    async def _decide(self, pool: ProcessPoolExecutor, traffic: Traffic | None) -> None:
        workers = self.flex()
        if len(workers) < 2 or traffic is None or traffic.requests < 2 * len(workers):
            return
        s = self.settings
        assert self.profile is not None
        current = layout_of(self.pairing.roles, workers)
        slo = router_slo(s)
        loop = asyncio.get_running_loop()
        decision = await loop.run_in_executor(pool, decide, self.profile, traffic, slo, len(workers), current, s.planner_margin)
        self.decision = decision
        for p in decision.predictions:
            self.metrics.planner_predicted.labels(str(p.prefill)).set(p.goodput_per_gpu)
        if decision.moves and workers == self.flex():  # the workers did not change while it simulated
            decodes = {w.url: w.load.decodes for w in self.registry.role("flex")}
            self.apply(assign(decision.layout, workers, self.pairing.roles, decodes), decision.why, decision.split_prompts)
        elif not decision.moves:
            self.pairing.split_prompts = decision.split_prompts

    def apply(self, roles: dict[str, Role], why: str, split_prompts: Lengths | None = None) -> None:
        """Give the flexible workers ``roles`` (by URL; a worker not named serves whole requests), and prompts outside
        ``split_prompts`` whole to any of them (None: every prompt as the roles say); counted and logged."""
        before = layout_of(self.pairing.roles, self.flex())
        self.pairing.roles = dict(roles)
        self.pairing.split_prompts = split_prompts
        after = layout_of(roles, self.flex())
        self.moves += 1
        self.metrics.planner_moves.inc()
        self.metrics.planner_prefillers.set(after.prefill)
        log.info("planner roles %s", kv(before=before.name, after=after.name, roles=roles, split_prompts=bounds_json(split_prompts), why=why))

    def snapshot(self) -> dict[str, Any]:
        """What ``GET /planner`` shows: the roles by worker URL, the layout, and the last decision's predictions."""
        workers = self.flex()
        out: dict[str, Any] = {
            "id": self.id,
            "leads": self.leader == self.id if self.settings.planner_peers else self.decides,
            "leader": self.leader,
            "layout": layout_of(self.pairing.roles, workers).name,
            "roles": {w: self.pairing.roles.get(w, "whole") for w in workers},
            "split_prompts": bounds_json(self.pairing.split_prompts),
            "prompt_tokens_per_estimate": round(self.traffic.prompt_ratio, 3),  # how the workers count the text (4 bytes a token: 1)
            "moves": self.moves,
        }
        if self.decision is not None:
            out["why"] = self.decision.why
            out["predictions"] = [
                {"layout": p.layout, "goodput_per_gpu": p.goodput_per_gpu, "throughput_rps": p.throughput_rps} for p in self.decision.predictions
            ]
        return out


    def peer(self) -> dict[str, Any]:
        """What ``GET /planner/peer`` shares with the other routers: who this is, whether it can decide, its roles and traffic."""
        view = self.traffic.view(time.perf_counter())
        return {
            "id": self.id,
            "decides": self.decides,
            "roles": dict(self.pairing.roles),
            "split_prompts": bounds_json(self.pairing.split_prompts),
            "window": window_json(view),
        }


async def _addresses(url: str) -> list[str]:
    """``url`` at each address its host name resolves to (a headless Service: every router); as it is where it does not resolve."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except OSError:
        return [url]
    hosts = dict.fromkeys(info[4][0] for info in infos)
    return [f"{parts.scheme}://{f'[{h}]' if ':' in h else h}:{port}" for h in hosts] or [url]
