"""A worker's side of the router's admin API: register, heartbeat, drain, deregister.

Runs in the worker service's process next to the vLLM child. Failures to reach
the router are logged and retried on the next heartbeat: a router restart must
not take workers down, and a worker re-registers when the router forgot it.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

from connector.compat import WorkerIdentity
from services.common.logs import kv
from services.common.prom import metric_label, metric_sum

__all__ = ["RouterLink", "block_size", "running_requests"]

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


def block_size(vllm_url: str) -> int | None:
    """The KV block size the running vLLM chose (None when it cannot be read): part of what the router pairs by."""
    try:
        value = metric_label(_metrics(vllm_url), "vllm:cache_config_info", "block_size")
    except (urllib.error.URLError, OSError):
        return None
    return int(value) if value and value.isdigit() else None


def running_requests(vllm_url: str) -> float:
    """Requests vLLM is running or has waiting (from its Prometheus gauges)."""
    text = _metrics(vllm_url)
    return metric_sum(text, "vllm:num_requests_running") + metric_sum(text, "vllm:num_requests_waiting")


class RouterLink:
    """This worker's registration with one router, kept alive by a heartbeat thread."""

    def __init__(self, router_url: str, advertise_url: str, identity: WorkerIdentity, token: str | None, interval_s: float) -> None:
        self.router_url = router_url.rstrip("/")
        self.advertise_url = advertise_url.rstrip("/")
        self.identity = identity
        self.token = token
        self.interval_s = interval_s
        self.worker_id: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")

    def register(self) -> bool:
        body = {"url": self.advertise_url, "role": self.identity.role, "identity": self.identity.to_json()}
        try:
            self.worker_id = _http("POST", self.router_url + "/admin/workers", body, self.token)["id"]
        except urllib.error.HTTPError as exc:
            log.error("router refused registration %s: %s", kv(status=exc.code), exc.read().decode(errors="replace"))
            return False
        except (urllib.error.URLError, OSError) as exc:
            log.warning("router unreachable, will retry %s", kv(router=self.router_url, error=exc))
            return False
        log.info("registered %s", kv(router=self.router_url, id=self.worker_id))
        return True

    def start(self) -> None:
        self.register()
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.worker_id is None:
                self.register()
                continue
            try:
                _http("POST", f"{self.router_url}/admin/workers/{self.worker_id}/heartbeat", {}, self.token)
            except urllib.error.HTTPError as exc:
                if exc.code == 404:  # the router forgot us (restart, expiry): join again
                    self.worker_id = None
                    self.register()
            except (urllib.error.URLError, OSError):
                pass

    def drain(self) -> None:
        """Ask the router to send nothing new here."""
        self._stop.set()
        if self.worker_id is not None:
            try:
                _http("POST", f"{self.router_url}/admin/workers/{self.worker_id}/drain", {}, self.token)
            except (urllib.error.URLError, OSError) as exc:
                log.warning("drain not acknowledged %s", kv(error=exc))

    def deregister(self) -> None:
        if self.worker_id is not None:
            try:
                _http("DELETE", f"{self.router_url}/admin/workers/{self.worker_id}", None, self.token)
                log.info("deregistered %s", kv(id=self.worker_id))
            except (urllib.error.URLError, OSError) as exc:
                log.warning("deregistration failed %s", kv(error=exc))
