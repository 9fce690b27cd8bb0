"""A whole P/D deployment on one machine: N prefill + M decode workers and the router.

``hybrid-pd up`` and the end-to-end tests both use :class:`Stack`. Each service
runs as the same ``hybrid-pd prefill|decode|router`` command a container runs, in
its own process group, so stopping the stack stops every process it started.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen

from hybrid_pd.common.logs import kv
from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok

__all__ = ["Service", "Stack", "StackConfig", "StackError", "watch"]

log = logging.getLogger("hybrid_pd.stack")


class StackError(RuntimeError):
    """A service of the stack failed to start."""


@dataclass(frozen=True)
class StackConfig:
    """What to start. Ports of workers are picked free at start unless given."""

    model: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    device: str = "cpu"
    baseline: bool = False
    log_dir: Path = field(default_factory=lambda: Path.cwd() / ".hybrid-pd" / "logs")
    ready_timeout_s: float = 900.0
    worker_args: tuple[str, ...] = ()
    timeline_dir: Path | None = None  # the router and the P/D workers record the hand-off timeline here


@dataclass(frozen=True)
class Service:
    """One process of the stack: its name, command and the URL that answers when it is ready."""

    name: str
    argv: list[str]
    url: str
    health: str


def _cli() -> list[str]:
    return [sys.executable, "-m", "hybrid_pd.cli"]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Stack:
    """Start, check and stop a local P/D deployment."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.services = self._plan()
        self._procs: dict[str, Popen] = {}

    @property
    def url(self) -> str:
        """The router's base URL, the one public endpoint."""
        return f"http://{self.config.host}:{self.config.port}"

    def workers(self, role: str) -> list[Service]:
        return [s for s in self.services if s.name.startswith(role)]

    def _plan(self) -> list[Service]:
        cfg = self.config
        services: list[Service] = []
        index = 0
        roles = (("prefill", cfg.prefill), ("decode", cfg.decode), ("colocated", int(cfg.baseline)))
        for role, count in roles:
            for i in range(count):
                port = free_port()
                argv = _cli() + [
                    role,
                    "--model", cfg.model,
                    "--served-model-name", cfg.served_model_name,
                    "--host", "127.0.0.1",
                    "--port", str(port),
                    "--device", cfg.device,
                    *cfg.worker_args,
                ]  # fmt: skip
                if role != "colocated":
                    argv += ["--side-channel-port", str(free_port())]
                    argv += ["--timeline-dir", str(cfg.timeline_dir)] if cfg.timeline_dir else []
                if cfg.device == "cpu":
                    argv += ["--cpu-threads-bind", str(index % _cores())]
                index += 1
                url = f"http://127.0.0.1:{port}"
                services.append(Service(f"{role}-{i}", argv, url, url + "/health"))
        router = _cli() + ["router", "--host", cfg.host, "--port", str(cfg.port)]
        router += ["--timeline-dir", str(cfg.timeline_dir)] if cfg.timeline_dir else []
        for role in ("prefill", "decode"):
            for s in services:
                if s.name.startswith(role):
                    router += ["--" + role, s.url]
        services.append(Service("router", router, self.url, self.url + "/health"))
        return services

    def start(self) -> None:
        """Start every service and wait until all are ready; raise StackError if one is not."""
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        for service in self.services:
            self._procs[service.name] = spawn(service.argv, log=self.log_path(service.name))
        for service in self.services:
            self._await_ready(service)

    def restart(self, name: str) -> None:
        """Start service ``name`` again (after a crash, in fault tests), same command and ports; :meth:`wait_ready` waits for it.

        Call it from a thread that lives as long as the stack: a child gets SIGTERM when the
        thread that started it ends (``PR_SET_PDEATHSIG``), so a restart from a short-lived
        worker thread was stopped again a moment after it came up (seen).
        """
        service = self._service(name)
        stop_group(self._procs[name])  # whatever is left of the old one
        self._procs[name] = spawn(service.argv, log=self.log_path(name))

    def wait_ready(self, name: str) -> None:
        """Wait until service ``name`` is ready (blocking: any thread may wait); StackError if it is not."""
        self._await_ready(self._service(name))

    def _service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def _await_ready(self, service: Service) -> None:
        proc = self._procs[service.name]
        if not wait_http_ok(service.health, lambda: proc.poll() is None, self.config.ready_timeout_s):
            self.stop()
            raise StackError(f"{service.name} did not become ready; see {self.log_path(service.name)}")
        if service.name == "router":
            self._wait_until_router_routes_to_all(service)
        else:
            self._check_identity(service)
        log.info("ready %s", kv(service=service.name, url=service.url))

    def _wait_until_router_routes_to_all(self, router: Service) -> None:
        """Check the router is ours, then wait until it routes to every worker we started.

        It evicts workers that are still loading and re-admits them on its next health
        check; until then requests would skip the prefill leg (local prefill).
        """
        ours = {s.url for s in self.workers("prefill") + self.workers("decode")}
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            with urllib.request.urlopen(router.health, timeout=5) as resp:
                health = json.load(resp)
            if set(health.get("prefill", [])) | set(health.get("decode", [])) != ours:
                self.stop()
                raise StackError(f"{router.url} is another router: {health}")
            available = health.get("available", {})
            if set(available.get("prefill", [])) | set(available.get("decode", [])) == ours:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise StackError(f"the router does not route to every worker: {health}")
            time.sleep(0.2)

    def _check_identity(self, service: Service) -> None:
        """Make sure the worker's port answers with our process, not another one on a shared machine."""
        with urllib.request.urlopen(service.url + "/v1/models", timeout=5) as resp:
            models = json.load(resp)
        roots = {m.get("root") for m in models.get("data", [])}
        if self.config.model not in roots:
            self.stop()
            raise StackError(f"{service.url} serves {roots}, not our {self.config.model}")

    def log_path(self, name: str) -> Path:
        return self.config.log_dir / f"{name}.log"

    def failed(self) -> list[str]:
        """Names of services whose process has exited."""
        return [name for name, proc in self._procs.items() if proc.poll() is not None]

    def stop(self) -> None:
        """Stop every service (router first), waiting for each process group to end."""
        for name in reversed(list(self._procs)):
            stop_group(self._procs.pop(name))

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def watch(stack: Stack, poll_s: float = 1.0) -> str:
    """Block while the stack can serve; return why it cannot. KeyboardInterrupt propagates.

    A worker that exits is reported once and the router routes around it (a dead
    prefill worker means local prefill); the stack is done when the router or the
    last decode worker is gone.
    """
    reported: set[str] = set()
    while True:
        for name in stack.failed():
            if name not in reported:
                reported.add(name)
                log.error("%s exited; see %s", name, stack.log_path(name))
        if "router" in reported:
            return "the router exited"
        if all(s.name in reported for s in stack.workers("decode")):
            return "no decode worker is left"
        time.sleep(poll_s)
