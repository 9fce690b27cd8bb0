"""Child processes that never outlive their parent, and free ports to give them."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO

__all__ = ["free_port", "spawn", "stop_group"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the parent's own cleanup still stops the group
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the kernel picks it, so parallel callers differ)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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

