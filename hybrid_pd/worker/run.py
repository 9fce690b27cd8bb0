"""Run a worker: one vLLM server with the connector configuration of its role.

``hybrid-pd prefill|decode|colocated`` run :func:`run_worker` with their role. It
starts vLLM as a child in its own process group, relays its output, reports
readiness, stops vLLM on SIGTERM/SIGINT and, when vLLM fails to start, exits
non-zero with the lines of vLLM's log that say why.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error

from hybrid_pd.common.logs import error_lines, kv
from hybrid_pd.common.processes import spawn, stop_group, wait_http_ok
from hybrid_pd.connector.compat import IncompatibleWorkers
from hybrid_pd.connector.identity import worker_identity
from hybrid_pd.connector.launch import Role, WorkerSpec, build_launch, dtype
from hybrid_pd.connector.model_check import check_model
from hybrid_pd.connector.vllm.capabilities import checked
from hybrid_pd.worker.registration import RouterLink, block_size, running_requests
from hybrid_pd.worker.settings import WorkerSettings

__all__ = ["run_worker"]

log = logging.getLogger("hybrid_pd.worker")


# vLLM lines after which it will never become ready, though its process lives on: the NIXL
# side-channel listener is a thread; when it dies (its port taken), the engine waits for it forever.
_FATAL_LINES = ("Exception in thread nixl_handshake_listener",)


def _relay(stream, tail: collections.deque[str], fatal: threading.Event) -> None:
    """Copy vLLM's output to ours, keep its tail, and set ``fatal`` on a line vLLM cannot recover from."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        tail.append(line.rstrip("\n"))
        if line.startswith(_FATAL_LINES):
            fatal.set()
        sys.stdout.write(line)
        sys.stdout.flush()


def _side_channel_in_use(spec: WorkerSpec) -> str | None:
    """Why vLLM could not listen on the NIXL side-channel port, or None when it can (checked before starting it)."""
    if spec.role == "colocated":
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((spec.side_channel_host, spec.side_channel_port))
        except OSError as exc:
            return f"NIXL side channel {spec.side_channel_host}:{spec.side_channel_port}: {exc.strerror or exc}"
    return None


def _why_it_failed(tail: collections.deque[str], limit: int = 8) -> str:
    return "\n".join(error_lines(tail, limit) or list(tail)[-limit:])


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


def run_worker(role: Role, settings: WorkerSettings) -> int:
    """Run one vLLM server for ``role`` until it exits or we are told to stop; return the exit code."""
    spec = settings.spec(role)
    if (taken := _side_channel_in_use(spec)) is not None:
        log.error("cannot start vLLM: %s; give each worker on a host its own --side-channel-port", taken)
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
    proc = spawn(launch.argv, launch.env, log=subprocess.PIPE)
    tail: collections.deque[str] = collections.deque(maxlen=400)
    fatal = threading.Event()
    relay = threading.Thread(target=_relay, args=(proc.stdout, tail, fatal), daemon=True)
    relay.start()

    stopping = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)

    vllm_url = f"http://{settings.host}:{settings.port}"
    link: RouterLink | None = None
    if wait_http_ok(vllm_url + "/health", lambda: proc.poll() is None and not stopping.is_set() and not fatal.is_set(), settings.ready_timeout_s):
        log.info("ready %s", kv(role=role, url=vllm_url))
        if settings.router_url and role != "colocated":
            identity = worker_identity(spec, block_size(vllm_url))
            link = RouterLink(
                settings.router_urls,
                settings.advertise_url or vllm_url,
                identity,
                settings.admin_token,
                settings.heartbeat_interval_s,
                every_address=settings.router_every_address,
            )
            link.start()
    elif not stopping.is_set():
        stop_group(proc)
        relay.join(timeout=5)
        if fatal.is_set():
            reason = "failed and will not become ready"
        elif proc.returncode not in (None, -signal.SIGTERM):
            reason = "exited"
        else:
            reason = "did not become ready"
        log.error("vLLM %s (%s):\n%s", reason, kv(role=role, code=proc.returncode), _why_it_failed(tail))
        return proc.returncode or 1

    while not stopping.is_set() and proc.poll() is None:
        stopping.wait(0.5)
    if proc.poll() is not None:
        relay.join(timeout=5)
        log.error("vLLM exited %s:\n%s", kv(role=role, code=proc.returncode), _why_it_failed(tail))
        return proc.returncode or 1
    log.info("stopping %s", kv(role=role))
    _drain(link, vllm_url, settings.drain_timeout_s)
    stop_group(proc)
    return 0
