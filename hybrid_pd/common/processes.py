"""Child processes that never outlive their parent, what /proc says of their group, free ports to give them, and waiting until they answer."""

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "Proc",
    "describe_status",
    "free_port",
    "listen_problem",
    "process_group",
    "remove_unmapped",
    "shared_memory_of",
    "spawn",
    "stop_group",
    "wait_http_ok",
]

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
    """SIGTERM the process group led by ``proc``, SIGKILL it after ``grace_s``; return the exit code.

    SIGCONT follows the SIGTERM: a stopped process (SIGSTOP) would hold its SIGTERM until the
    SIGKILL and so skip its own cleanup.
    """
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGCONT)
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


@dataclass(frozen=True)
class Proc:
    """One process as /proc shows it at one moment."""

    pid: int
    ppid: int
    pgid: int
    state: str  # R, S, D, T (stopped), Z (zombie: dead, not reaped yet), ...
    started: int  # clock ticks after boot: with the pid, tells a reused pid from the process seen before
    title: str  # its command line, NULs as spaces; what setproctitle wrote (VLLM::Worker); empty for a zombie
    status: int  # for a zombie, its exit status as waitpid(2) reports it

    @property
    def zombie(self) -> bool:
        return self.state == "Z"

    @property
    def stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP, SIGTSTP): it runs again only on SIGCONT."""
        return self.state == "T"


def _read_proc(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:  # gone between the listing and the read
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name in parentheses may hold spaces
    # proc(5): state is field 3; ppid 4, pgrp 5, starttime 22, exit_code 52 (Linux 3.5+).
    status = int(fields[49]) if len(fields) > 49 else 0
    return Proc(pid, int(fields[1]), int(fields[2]), fields[0], int(fields[19]), title, status)


def process_group(pgid: int) -> dict[int, Proc]:
    """Every process of group ``pgid``, zombies included, by pid; empty where /proc is not Linux's."""
    found = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if name.isdigit() and (proc := _read_proc(int(name))) is not None and proc.pgid == pgid:
            found[proc.pid] = proc
    return found


def describe_status(status: int) -> str:
    """A waitpid(2) status in words: ``exited with status 1``, ``was killed by SIGKILL``."""
    if os.WIFSIGNALED(status):
        core = " (core dumped)" if os.WCOREDUMP(status) else ""
        return f"was killed by {_signal_name(os.WTERMSIG(status))}{core}"
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return f"ended (wait status {status})"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


_SHM = "/dev/shm/"


def _mapped_shm(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if _SHM in line and not line.rstrip().endswith("(deleted)")}
    except (OSError, IndexError):
        return set()


def shared_memory_of(pids: Iterable[int]) -> set[str]:
    """The files under /dev/shm these processes have mapped (shared-memory segments, semaphores)."""
    return set().union(*(_mapped_shm(pid) for pid in pids))


def remove_unmapped(paths: Iterable[str]) -> list[str]:
    """Remove those of ``paths`` no process maps any more; the removed ones.

    What a process group killed with SIGKILL leaves behind: a segment is unlinked by the process
    that made it, or by multiprocessing's resource tracker, and neither ran to its end. The files
    live in memory (tmpfs) until removed: vLLM's broadcast queue is 250 MB on CPU.
    """
    candidates = {p for p in paths if os.path.exists(p)}
    if not candidates:
        return []
    in_use = shared_memory_of(int(name) for name in os.listdir("/proc") if name.isdigit())
    removed = []
    for path in sorted(candidates - in_use):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed
