"""Run a worker: one vLLM server with the connector configuration of its role.

``hybrid-pd prefill|decode|colocated`` run :func:`run_worker` with their role. It
starts vLLM as a child in its own process group, relays its output, reports
readiness, stops vLLM on SIGTERM/SIGINT, and watches it (:mod:`hybrid_pd.worker.supervise`):
when a process of vLLM dies or hangs, or vLLM cannot start, it stops vLLM and exits non-zero
with one line that says what happened and vLLM's last lines, so whatever runs the worker
(``hybrid-pd up``, Compose, Kubernetes) starts it again.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error

from hybrid_pd.common.logs import error_lines, kv
from hybrid_pd.common.processes import (
    process_group,
    remove_unmapped,
    shared_memory_of,
    spawn,
    stop_group,
)
from hybrid_pd.connector.compat import IncompatibleWorkers
from hybrid_pd.connector.contract import ENGINE_FIXES_ENV
from hybrid_pd.connector.identity import worker_identity
from hybrid_pd.connector.launch import Role, WorkerSpec, build_launch, dtype, handoff_inbox
from hybrid_pd.connector.model_check import check_model
from hybrid_pd.connector.vllm.capabilities import checked
from hybrid_pd.worker.plugin_registration import plugin_path
from hybrid_pd.worker.registration import RouterLink, cache_facts, running_requests
from hybrid_pd.worker.settings import WorkerSettings
from hybrid_pd.worker.stacks import dump_stacks
from hybrid_pd.worker.supervise import (
    HttpChecks,
    Observation,
    OutputRelay,
    WatchState,
    Windows,
    judge,
    long_lived,
)

__all__ = ["EXIT_VLLM_FAILED", "run_worker"]

log = logging.getLogger("hybrid_pd.worker")

# How often vLLM's process group is read from /proc: a death is seen within this (a read costs ~3 ms).
_POLL_S = 0.5
# The exit code of a worker whose vLLM died, hung or could not start (2: refused before vLLM started).
EXIT_VLLM_FAILED = 3
# How long a failed vLLM may take to stop on SIGTERM: one that lost a process may never finish its
# own shutdown (its API server, mid-start, ignored SIGTERM for the 15 s a healthy stop gets).
_FAILED_STOP_GRACE_S = 5.0
# How long one process's stack dump may take (py-spy reads a vLLM process in ~0.1-0.5 s).
_DUMP_TIMEOUT_S = 10.0


def _port_in_use(spec: WorkerSpec) -> str | None:
    """Why vLLM could not listen on the NIXL side-channel port or its engine on the early legs' inbox (every interface),
    or None when both are free (checked before starting it)."""
    wanted = [] if spec.role == "colocated" else [("NIXL side channel", spec.side_channel_host, spec.side_channel_port)]
    if handoff_inbox(spec) is not None:
        wanted.append(("early legs' inbox", "0.0.0.0", spec.handoff_port))
    for what, host, port in wanted:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError as exc:
                return f"{what} {host}:{port}: {exc.strerror or exc}"
    return None


def _why_it_failed(tail: collections.deque[str], last: int = 8, earlier_errors: int = 4) -> str:
    """vLLM's last lines, after its last lines that say why it failed (tracebacks, lines logged at ERROR) where those came earlier.

    A process killed by a signal says nothing itself: vLLM's last lines show where it was.
    """
    lines = list(tail)
    cut = max(0, len(lines) - last)
    errors = set(error_lines(lines, len(lines)))
    before = [line for line in lines[:cut] if line in errors or " ERROR " in line or " CRITICAL " in line]
    return "\n".join(before[-earlier_errors:] + lines[cut:])


def _drain(link: RouterLink | None, vllm_url: str, timeout_s: float) -> None:
    """Stop new work (every router replica drains it), let in-flight requests finish within ``timeout_s``, leave every replica."""
    if link is None:
        return
    link.drain()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if running_requests(vllm_url) == 0:
                break
        except (urllib.error.URLError, OSError):
            break
        time.sleep(0.5)
    link.deregister()


def with_capabilities(spec: WorkerSpec, decode_row_fix: str) -> WorkerSpec | None:
    """``spec`` with what the installed vLLM offers for P/D, fallbacks included; None (logged) if it lacks a piece.

    The probes run vLLM's own code in a child process (:mod:`hybrid_pd.connector.vllm.capabilities`); a
    colocated server needs nothing of it.
    """
    if spec.role == "colocated":
        return spec
    try:
        report, cached = checked(spec.role, spec.device, decode_row_fix, build_launch(spec).env)
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run must not let vLLM start unchecked
        log.error("cannot start vLLM: the capability check of the installed vLLM failed: %s", exc)
        return None
    if (missing := report.refusal()) is not None:
        log.error("cannot start vLLM: the installed vLLM lacks what hybrid P/D needs:\n%s", missing)
        return None
    for finding in report.findings:
        if finding.fallback:
            log.warning("FALLBACK %s: %s", kv(capability=finding.name, fallback=finding.fallback), finding.detail)
    log.info("vLLM %s capabilities%s: %s", report.vllm_version, " (cached)" if cached else "", kv(**report.states()))
    return dataclasses.replace(spec, capabilities=tuple(report.states().items()))


def with_plugin(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a vLLM server that loads our plugin where the launch names engine fixes, installed or not
    (:mod:`hybrid_pd.worker.plugin_registration`)."""
    if ENGINE_FIXES_ENV not in env or (path := plugin_path(os.environ.get("PYTHONPATH"))) is None:
        return env
    log.warning("hybrid-pd is not installed here: its vLLM plugin (engine fixes %s) is registered for this server through PYTHONPATH=%s",
                env[ENGINE_FIXES_ENV], path)  # fmt: skip
    return {**env, "PYTHONPATH": path}


def run_worker(role: Role, settings: WorkerSettings) -> int:
    """Run one vLLM server for ``role`` until it fails or we are told to stop; return the exit code."""
    spec = settings.spec(role)
    if (taken := _port_in_use(spec)) is not None:
        log.error("cannot start vLLM: %s; give each worker on a host its own --side-channel-port (and --handoff-port)", taken)
        return 2
    try:
        check_model(spec.model, role, spec.device, speculates=spec.speculative_config is not None, dtype=dtype(spec))
    except IncompatibleWorkers as exc:
        log.error("cannot start vLLM: %s", exc)
        return 2
    if (spec := with_capabilities(spec, settings.decode_row_fix)) is None:
        return 2
    launch = build_launch(spec)
    log.info("starting vLLM %s", kv(role=role, port=settings.port, side_channel=settings.side_channel_port))
    log.info("vLLM command: %s", " ".join(launch.argv))
    for reason in launch.reasons:
        log.info("%s", reason)
    proc = spawn(launch.argv, with_plugin(launch.env), log=subprocess.PIPE)
    relay = OutputRelay(proc.stdout)

    stopping = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)

    vllm_url = f"http://{settings.host}:{settings.port}"
    windows = Windows(settings.start_stall_s, settings.serve_stall_s, settings.ready_timeout_s, settings.device)
    # Ten checks a window: a failing /health is timed to a tenth of it.
    checks = HttpChecks(vllm_url, spec.served_model_name, interval_s=min(5.0, max(0.5, settings.serve_stall_s / 10)),
                        request_timeout_s=min(5.0, settings.serve_stall_s / 2))  # fmt: skip
    state = WatchState(spawned_at=time.monotonic())
    link: RouterLink | None = None
    ready = False
    segments: set[str] = set()  # shared memory vLLM's processes mapped, removed if a failure leaves it behind
    failure: str | None = None
    stalled = False
    waits_dumped = 0
    while not stopping.is_set():
        state, decision = judge(state, _observe(proc, relay, checks), windows)
        if (failure := decision.failure) is not None:
            stalled = decision.stalled
            break
        if decision.probe:
            checks.probe()
        if ready and relay.engine_waits > waits_dumped:  # where a wedged process stands, while it still does
            waits_dumped = relay.engine_waits
            log.error("vLLM says one of its processes waited 60 s for another while serving (%s); where they stand (py-spy dump):\n%s",
                      kv(role=role, pid=proc.pid), dump_stacks(long_lived(process_group(proc.pid), proc.pid), _DUMP_TIMEOUT_S))
        if not ready and checks.ready_at is not None:
            ready = True
            segments = shared_memory_of(process_group(proc.pid))  # a process that dies later maps nothing any more
            link = _ready(role, settings, spec, vllm_url, relay.attention_block)
        stopping.wait(_POLL_S)
    checks.stop()
    if failure is not None:
        relay.join(0.5)  # what a dying process wrote last may still be in the pipe
        log.error("vLLM ended (%s): %s; its last lines:\n%s", kv(role=role, pid=proc.pid), failure, _why_it_failed(relay.tail))
        if stalled:  # where each process stands, before they are ended (issue #36)
            log.error("where vLLM's processes stood (py-spy dump):\n%s", dump_stacks(long_lived(process_group(proc.pid), proc.pid), _DUMP_TIMEOUT_S))
        if link is not None:
            link.drain()
            link.deregister()
        segments |= shared_memory_of(process_group(proc.pid))
        stop_group(proc, grace_s=_FAILED_STOP_GRACE_S)
        if removed := remove_unmapped(segments):
            log.info("removed the shared memory vLLM left %s", kv(role=role, files=",".join(removed)))
        return EXIT_VLLM_FAILED
    log.info("stopping %s", kv(role=role))
    _drain(link, vllm_url, settings.drain_timeout_s)
    stop_group(proc)
    return 0


def _ready(role: Role, settings: WorkerSettings, spec: WorkerSpec, vllm_url: str, engine_block: int | None) -> RouterLink | None:
    """vLLM answered /health: say so, and register with the routers (P/D roles) and heartbeat."""
    log.info("ready %s", kv(role=role, url=vllm_url))
    if not settings.router_url or role == "colocated":
        return None
    link = RouterLink(
        settings.router_urls,
        settings.advertise_url or vllm_url,
        worker_identity(spec, *cache_facts(vllm_url, engine_block)),
        settings.admin_token,
        settings.heartbeat_interval_s,
        every_address=settings.router_every_address,
    )
    link.start()
    return link


def _observe(proc: subprocess.Popen, relay: OutputRelay, checks: HttpChecks) -> Observation:
    """What is seen of vLLM now; /proc before Popen.poll, which reaps a dead API server and so hides its zombie."""
    group = process_group(proc.pid)
    return Observation(
        at=time.monotonic(),
        leader=proc.pid,
        group=group,
        output_at=relay.output_at,
        phase=relay.phase,
        leader_returncode=proc.poll(),
        fatal_line=relay.fatal_line,
        ready_at=checks.ready_at,
        health_ok_at=checks.health_ok_at,
        engine=checks.engine,
        probe_sent_at=checks.probe_sent_at,
        probe_answered_at=checks.probe_answered_at,
    )
