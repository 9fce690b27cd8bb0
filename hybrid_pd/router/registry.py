"""The router's view of its workers: who they are, whether they are healthy, how busy.

Static workers come from settings; dynamic ones register through the admin API
and heartbeat. A health loop evicts a worker after consecutive failed checks and
re-admits it once it answers again. Pairing follows :mod:`hybrid_pd.connector.compat`. A leg
in flight on a worker is a :class:`Lease` the registry hands out, so the counts
the policies read go up and down in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, get_args

import httpx
from prometheus_client import Gauge

from hybrid_pd.common.logs import kv
from hybrid_pd.common.prom import cache_block_size, prefix_hit_tokens
from hybrid_pd.connector.compat import IncompatibleWorkers, WorkerIdentity, check_pair, check_worker
from hybrid_pd.connector.contract import HANDOFF_PATH
from hybrid_pd.router.load import LiveLoad
from hybrid_pd.router.prefix_index import SentPrefixes
from hybrid_pd.router.upstream import Upstream

__all__ = ["DECODERS", "PREFILLERS", "ROLES", "Lease", "Registry", "Worker", "can_pair", "probe_identity"]

log = logging.getLogger("hybrid_pd.router.registry")

RoleName = Literal["prefill", "decode", "flex"]
ROLES: tuple[RoleName, ...] = get_args(RoleName)
# Who can take which leg: a flexible worker (vLLM's kv_both) prefills for others and decodes.
PREFILLERS: tuple[RoleName, ...] = ("prefill", "flex")
DECODERS: tuple[RoleName, ...] = ("decode", "flex")
# What a leg does on its worker: prefill for another worker, or decode (its own prefill included when local).
LegKind = Literal["prefill", "decode"]


@dataclass
class Worker:
    """One prefill, decode or flexible worker and its live state."""

    url: str
    role: RoleName
    identity: WorkerIdentity
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    static: bool = False
    # None until the first health check answers: a worker is not routed to before it has
    # answered once (a router that counted its static workers healthy at start said 200 on
    # /health ~85 s before it could serve).
    healthy: bool | None = None
    draining: bool = False
    failures: int = 0
    inflight: int = 0
    inflight_tokens: int = 0
    load: LiveLoad = field(default_factory=LiveLoad)
    # The prompts the router sent here, for the prefix_reuse policy (hybrid_pd/router/prefix_index.py).
    prefixes: SentPrefixes = field(default_factory=SentPrefixes, repr=False, compare=False)
    # A prefilling worker: whether its host reaches each decode engine's inbox it was asked of, and when it said so
    # (hybrid_pd/router/inbox_reach.py).
    inboxes: dict[str, tuple[bool, float]] = field(default_factory=dict, repr=False, compare=False)
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def available(self) -> bool:
        return self.healthy is True and not self.draining

    def view(self) -> dict:
        """What ``GET /admin/workers`` shows."""
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role,
            "state": "draining" if self.draining else {True: "healthy", False: "evicted", None: "unknown"}[self.healthy],
            "static": self.static,
            "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens,
            "consecutive_failures": self.failures,
            "identity": self.identity.to_json(),
            **({"reaches_inboxes": {inbox: answer[0] for inbox, answer in self.inboxes.items()}} if self.inboxes else {}),
        }


def can_pair(a: Worker, b: Worker) -> bool:
    """Whether one of two workers (either order) can hand its state to the other: a prefill or flexible worker to a decode or flexible one."""
    prefill, decode = (a, b) if a.role == "prefill" or b.role == "decode" else (b, a)
    try:
        check_pair(prefill.identity, decode.identity)
    except IncompatibleWorkers:
        return False
    return True


class Lease:
    """One leg in flight on a worker: counted from :meth:`Registry.lease` until :meth:`release`.

    Whichever path ends the leg (its answer closed, an error, the client leaving) releases it,
    and more than one may: the count drops once. As a context manager it is released when the
    block ends, however it ends. A decode leg also counts as one of the worker's decodes.
    """

    __slots__ = ("worker", "_tokens", "_gauge", "_held", "_decodes", "_prefill_tokens")

    def __init__(self, worker: Worker, tokens: int, gauge: Gauge | None, kind: LegKind = "decode") -> None:
        self.worker = worker
        self._tokens = tokens
        self._gauge = gauge
        self._held = True
        self._decodes = kind == "decode"
        self._prefill_tokens = tokens if kind == "prefill" else 0
        worker.inflight += 1
        worker.inflight_tokens += tokens
        worker.load.decodes += self._decodes
        worker.load.prefill_tokens += self._prefill_tokens
        if gauge is not None:
            gauge.set(worker.inflight)

    def release(self) -> None:
        """Stop counting the leg; a second call does nothing."""
        if not self._held:
            return
        self._held = False
        self.worker.inflight -= 1
        self.worker.inflight_tokens -= self._tokens
        self.worker.load.decodes -= self._decodes
        self.worker.load.prefill_tokens -= self._prefill_tokens
        if self._gauge is not None:
            self._gauge.set(self.worker.inflight)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


# Whom a worker of each role hands state to or takes it from.
_PEERS: dict[RoleName, tuple[RoleName, ...]] = {"prefill": DECODERS, "decode": PREFILLERS, "flex": ("prefill", "decode", "flex")}


class Registry:
    """All workers, by id; the only place that adds, removes or evicts one, or counts its legs in flight.

    ``inflight_gauge`` (labelled by role and URL) follows every worker's count of legs in flight.
    """

    def __init__(self, eviction_failures: int = 3, heartbeat_ttl_s: float = 30.0, inflight_gauge: Gauge | None = None) -> None:
        self._workers: dict[str, Worker] = {}
        # Each request looks up both roles: built once per change of membership, not per request.
        # Only add() and remove() change who is in a role; availability and load are read live.
        self._roles: dict[tuple[RoleName, ...], tuple[Worker, ...]] = {}
        self.eviction_failures = eviction_failures
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.evictions = 0
        self._inflight_gauge = inflight_gauge

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def by_url(self, url: str) -> Worker | None:
        return next((w for w in self._workers.values() if w.url == url), None)

    def role(self, *roles: RoleName) -> tuple[Worker, ...]:
        """Every worker of one of ``roles``, available or not, in registration order."""
        workers = self._roles.get(roles)
        if workers is None:
            workers = self._roles[roles] = tuple(w for w in self._workers.values() if w.role in roles)
        return workers

    def add(self, worker: Worker) -> Worker:
        """Register ``worker``; raise :class:`IncompatibleWorkers` if it can pair with none of the other role.

        A worker that registers again under the same URL replaces its old entry.
        """
        check_worker(worker.identity)
        peers = [p for p in self.role(*_PEERS[worker.role]) if p.url != worker.url]
        if peers and not any(can_pair(worker, peer) for peer in peers):
            peer = peers[0]
            pair = (worker.identity, peer.identity) if worker.role == "prefill" or peer.role == "decode" else (peer.identity, worker.identity)
            check_pair(*pair)  # raises with the field that differs
        old = self.by_url(worker.url)
        if old is not None:
            worker.id = old.id
        self._workers[worker.id] = worker
        self._roles.clear()
        if self._inflight_gauge is not None:  # a series from the start: 0 legs, not "no data"
            self._inflight_gauge.labels(worker.role, worker.url).set(worker.inflight)
        log.info("worker registered %s", kv(id=worker.id, role=worker.role, url=worker.url))
        return worker

    def remove(self, worker_id: str) -> Worker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._roles.clear()
            if self._inflight_gauge is not None and self.by_url(worker.url) is None:  # a gone worker's count is not 0, it is no more
                self._inflight_gauge.remove(worker.role, worker.url)
            log.info("worker removed %s", kv(id=worker.id, url=worker.url))
        return worker

    def lease(self, worker: Worker, tokens: int, kind: LegKind = "decode") -> Lease:
        """Count a leg of ``tokens`` prompt tokens as in flight on ``worker`` until the lease is released."""
        gauge = self._inflight_gauge.labels(worker.role, worker.url) if self._inflight_gauge is not None else None
        return Lease(worker, tokens, gauge, kind)

    def record_health(self, worker: Worker, ok: bool) -> None:
        """Count a health check; admit on success, evict after ``eviction_failures`` in a row."""
        if ok:
            if worker.healthy is not True:
                log.info("worker %s %s", "re-admitted" if worker.healthy is False else "admitted", kv(id=worker.id, url=worker.url))
            worker.failures, worker.healthy = 0, True
            self.touch(worker)
            return
        worker.failures += 1
        if worker.healthy is True and worker.failures >= self.eviction_failures:
            worker.healthy = False
            self.evictions += 1
            log.warning("worker evicted %s", kv(id=worker.id, url=worker.url, failures=worker.failures))

    def touch(self, worker: Worker) -> None:
        """A dynamic worker's heartbeat: its registration stays, its health is the health checks' to say.

        The heartbeat comes from the worker service, which lives on while its vLLM hangs
        (frozen, deadlocked): counted as a passed check, it would re-admit such a worker.
        """
        worker.last_seen = time.monotonic()

    def expire(self, now: float | None = None) -> list[Worker]:
        """Drop dynamic workers whose heartbeats stopped; static ones only get evicted."""
        now = time.monotonic() if now is None else now
        gone = [w for w in self.all() if not w.static and now - w.last_seen > self.heartbeat_ttl_s]
        for worker in gone:
            self.remove(worker.id)
        return gone

    async def check(self, worker: Worker, upstream: Upstream) -> None:
        """One health check of ``worker``: its vLLM server's ``/health``."""
        try:
            ok = (await upstream.get(worker.url + "/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            ok = False
        self.record_health(worker, ok)

    async def check_all(self, upstream: Upstream) -> None:
        """One round of health checks over every worker."""
        await asyncio.gather(*(self.check(w, upstream) for w in self.all()))
        self.expire()

    async def watch(self, upstream: Upstream, interval_s: float) -> None:
        """Every ``interval_s``, until cancelled: check every worker, learn identities of static workers, expire silent ones."""
        while True:
            await self.check_all(upstream)
            for worker in self.all():
                if worker.identity.model is None and worker.healthy is True:
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                        worker.identity = await probe_identity(upstream, worker.url, worker.role)
            await asyncio.sleep(interval_s)


def _inbox(probe_answer: bytes) -> str | None:
    """The engine inbox a worker's hand-off probe names (``{"handoff": 1, "inbox": "tcp://host:port"}``); None where it names none."""
    try:
        inbox = json.loads(probe_answer).get("inbox")
    except (ValueError, AttributeError):
        return None
    return inbox if isinstance(inbox, str) and inbox.startswith("tcp://") else None


async def probe_identity(upstream: Upstream, url: str, role: RoleName) -> WorkerIdentity:
    """Identity of a plain vLLM server from what it exposes: model, version, block size.

    dtype, TP size and conv layout are not exposed by vLLM; they stay unknown.
    """
    models = (await upstream.get(url + "/v1/models", timeout=5)).json()
    entry = models["data"][0]
    version = None
    try:
        version = (await upstream.get(url + "/version", timeout=5)).json().get("version")
    except (httpx.HTTPError, ValueError):
        pass
    handoff = inbox = None
    with contextlib.suppress(httpx.HTTPError):
        answer = await upstream.get(url + HANDOFF_PATH, timeout=5)
        handoff = answer.status_code == 200
        inbox = _inbox(answer.content) if handoff else None
    block_size = hit_tokens = None
    try:
        metrics = (await upstream.get(url + "/metrics", timeout=5)).text
        block_size, hit_tokens = cache_block_size(metrics), prefix_hit_tokens(metrics)
    except httpx.HTTPError:
        pass
    return WorkerIdentity(role=role, model=entry["id"], block_size=block_size, prefix_hit_tokens=hit_tokens, vllm_version=version, handoff=handoff,
                          handoff_inbox=inbox)
