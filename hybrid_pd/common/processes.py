"""Child processes that never outlive their parent, free ports to give them, and waiting until they answer."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["free_port", "listen_problem", "spawn", "stop_group", "wait_http_ok"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the parent's own cleanup still stops the group
        pass


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000
_handed_out: set[int] = set()


def _ephemeral_ports() -> range:
    """The ports the kernel hands out on its own (outgoing connections, binds to port 0)."""
    try:
        low, high = (int(x) for x in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now, outside the kernel's ephemeral range, not handed out before.

    A port picked by binding to port 0 comes from the ephemeral range, where any process's
    next outgoing connection or port-0 bind (vLLM's and UCX's own sockets included) may take
    it before the service it is meant for binds it: seen as a NIXL side-channel listener
    dying with "Address already in use". Ports below that range are only ever taken on
    purpose, and each call in a process returns a different one.
    """
    ephemeral = _ephemeral_ports()
    candidates = [p for p in range(_LOWEST_PORT, 65536) if p not in ephemeral and p not in _handed_out]
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free TCP port on {host} outside the ephemeral range {ephemeral.start}-{ephemeral.stop - 1}")


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (in use, not an address of this machine), or None.

    Binds as servers do (``SO_REUSEADDR``, like uvicorn), so connections of a server that just
    stopped, still in TIME_WAIT, do not count as the port being in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return f"{host}:{port}: {exc.strerror or exc}"
    return None


def spawn(argv: list[str], env: dict[str, str] | None = None, log: IO[bytes] | Path | int | None = None) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new process group that gets SIGTERM if we die.

    ``env`` is added to this process's environment. Output (stderr too) goes to
    ``log``: a file path, an open binary file or ``subprocess.PIPE``; else it is inherited.
    """
    out: IO[bytes] | int | None
    if isinstance(log, Path):
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab")  # noqa: SIM115 - the child owns it; closed below once handed over
    else:
        out = log
    try:
        return subprocess.Popen(
            argv,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
    finally:
        if isinstance(log, Path) and out is not None:
            out.close()


def stop_group(proc: subprocess.Popen, grace_s: float = 15.0) -> int | None:
    """SIGTERM the process group led by ``proc``, SIGKILL it after ``grace_s``; return the exit code."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(proc.pid):
                return proc.returncode
            time.sleep(0.1)
    return proc.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_http_ok(url: str, alive: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``url`` until it answers 200; False as soon as ``alive()`` is False or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False
