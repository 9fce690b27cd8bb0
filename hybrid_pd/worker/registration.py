"""A worker's side of the router's admin API: register, heartbeat, drain, deregister, with every router replica.

Runs in the worker service's process next to the vLLM child. Each router replica keeps
its own registry in memory, so a worker joins every replica its settings name: the
listed URLs, or (``--router-every-address``) every address their hosts resolve to, read
again on each heartbeat, as a Kubernetes headless Service names every router pod.
Failures to reach a replica are logged with its URL and retried on the next heartbeat,
never holding up the others: a router restart must not take workers down, and a worker
re-registers with a replica that forgot it.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from hybrid_pd.common.logs import kv
from hybrid_pd.common.prom import cache_block_size, metric_sum, prefix_hit_tokens
from hybrid_pd.connector.compat import WorkerIdentity

__all__ = ["Replica", "RouterLink", "cache_facts", "fan_out", "replica_urls", "resolve_host", "running_requests"]

log = logging.getLogger("hybrid_pd.worker.registration")


def _http(method: str, url: str, body: dict | None = None, token: str | None = None, timeout: float = 5) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def _metrics(vllm_url: str) -> str:
    """vLLM's Prometheus page."""
    with urllib.request.urlopen(vllm_url + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def cache_facts(vllm_url: str, engine_block: int | None = None) -> tuple[int | None, int | None]:
    """(block size, prefix-hit granule) the running vLLM chose, None where it cannot be read.

    The block size is part of what the router pairs by; the granule tells its prefix_reuse policy
    what this worker can resume (None: prefix caching off). ``engine_block``: the attention block
    the engine logged, which its metrics do not show.
    """
    try:
        text = _metrics(vllm_url)
    except (urllib.error.URLError, OSError):
        return None, None
    return cache_block_size(text), prefix_hit_tokens(text, engine_block)


def running_requests(vllm_url: str) -> float:
    """Requests vLLM is running or has waiting (from its Prometheus gauges)."""
    text = _metrics(vllm_url)
    return metric_sum(text, "vllm:num_requests_running") + metric_sum(text, "vllm:num_requests_waiting")


# A host name to the addresses it resolves to now; raises OSError when it resolves to none.
Resolver = Callable[[str], list[str]]


def resolve_host(host: str) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA records), the system resolver's order."""
    return [info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]


def _at(url: str, address: str) -> str:
    """``url`` with its host replaced by ``address``, same scheme and port."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    return parts._replace(netloc=host if parts.port is None else f"{host}:{parts.port}").geturl()


def fan_out(router_urls: tuple[str, ...], resolve: Resolver, known: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Each router URL's replicas: one URL per address its host resolves to now.

    A host that does not resolve keeps the replicas ``known`` has for it (none the first
    time), logged: a passing DNS failure must not drop a worker from every router, while
    a resolution that succeeds drops the addresses that left it.
    """
    found: dict[str, tuple[str, ...]] = {}
    for url in router_urls:
        try:
            found[url] = tuple(dict.fromkeys(_at(url, address) for address in resolve(urlsplit(url).hostname or "")))
        except OSError as exc:
            found[url] = known.get(url, ())
            log.warning("router host does not resolve, keeping its last replicas %s", kv(router=url, kept=len(found[url]), error=exc))
    return found


def replica_urls(replicas: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """Every replica URL once, in order."""
    return tuple(dict.fromkeys(url for urls in replicas.values() for url in urls))


@dataclass
class Replica:
    """One router replica and this worker's id there (None until it registered, or after the replica forgot it)."""

    url: str
    worker_id: str | None = None


@dataclass(frozen=True)
class _Registration:
    """What this worker sends every replica."""

    advertise_url: str
    identity: WorkerIdentity
    token: str | None

    def body(self) -> dict[str, Any]:
        return {"url": self.advertise_url, "role": self.identity.role, "identity": self.identity.to_json()}


class RouterLink:
    """This worker's registrations with every router replica, kept alive by one heartbeat thread.

    ``every_address`` fans each router URL out to every address its host resolves to
    (``resolve``, injectable for tests), again on every heartbeat: replicas that appear
    learn the worker within one interval, replicas whose address went away are dropped.
    """

    def __init__(
        self,
        router_urls: tuple[str, ...],
        advertise_url: str,
        identity: WorkerIdentity,
        token: str | None,
        interval_s: float,
        every_address: bool = False,
        resolve: Resolver = resolve_host,
    ) -> None:
        self.router_urls = tuple(url.rstrip("/") for url in router_urls)
        self.registration = _Registration(advertise_url.rstrip("/"), identity, token)
        self.interval_s = interval_s
        self.every_address = every_address
        self.resolve = resolve
        self.replicas: dict[str, Replica] = {}
        self._resolved: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()  # one round at a time: the heartbeat's, or drain's and deregister's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")

    def _refresh(self) -> None:
        """Follow the replicas the settings name now: new ones start unregistered, gone ones are dropped."""
        if self.every_address:
            self._resolved = fan_out(self.router_urls, self.resolve, self._resolved)
            urls = replica_urls(self._resolved)
        else:
            urls = self.router_urls
        for url in self.replicas.keys() - set(urls):
            log.info("router replica gone %s", kv(router=url, id=self.replicas[url].worker_id))
        self.replicas = {url: self.replicas.get(url) or Replica(url) for url in urls}

    def _register(self, replica: Replica) -> None:
        try:
            replica.worker_id = _http("POST", replica.url + "/admin/workers", self.registration.body(), self.registration.token)["id"]
        except urllib.error.HTTPError as exc:
            log.error("router refused registration %s: %s", kv(router=replica.url, status=exc.code), exc.read().decode(errors="replace"))
            return
        except (urllib.error.URLError, OSError) as exc:
            log.warning("router unreachable, will retry %s", kv(router=replica.url, error=exc))
            return
        log.info("registered %s", kv(router=replica.url, id=replica.worker_id))

    def _heartbeat(self, replica: Replica) -> None:
        """One heartbeat, or a registration where the replica does not know this worker (yet, or any more)."""
        if replica.worker_id is None:
            self._register(replica)
            return
        try:
            _http("POST", f"{replica.url}/admin/workers/{replica.worker_id}/heartbeat", {}, self.registration.token)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                log.warning("heartbeat refused, will retry %s", kv(router=replica.url, status=exc.code))
                return
            log.info("router forgot this worker, registering again %s", kv(router=replica.url, id=replica.worker_id))
            replica.worker_id = None  # the replica restarted or expired us: join again
            self._register(replica)
        except (urllib.error.URLError, OSError) as exc:
            log.warning("router unreachable, will retry %s", kv(router=replica.url, error=exc))

    def beat(self) -> None:
        """One round: find the replicas, then register with or heartbeat to each."""
        with self._lock:
            self._refresh()
            for replica in self.replicas.values():
                self._heartbeat(replica)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def _tell_each(self, method: str, action: str, what: str) -> None:
        """``method`` on each replica's ``/admin/workers/<id>`` + ``action``, logged per replica."""
        with self._lock:
            for replica in self.replicas.values():
                if replica.worker_id is None:
                    continue
                try:
                    _http(method, f"{replica.url}/admin/workers/{replica.worker_id}{action}", {} if action else None, self.registration.token)
                    log.info("%s %s", what, kv(router=replica.url, id=replica.worker_id))
                except (urllib.error.URLError, OSError) as exc:
                    log.warning("%s not acknowledged %s", what, kv(router=replica.url, error=exc))

    def drain(self) -> None:
        """Stop heartbeating and ask every replica to send nothing new here."""
        self._stop.set()
        self._tell_each("POST", "/drain", "drained")

    def deregister(self) -> None:
        """Leave every replica."""
        self._tell_each("DELETE", "", "deregistered")
