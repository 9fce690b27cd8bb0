"""The start loop (issue #36): start ``hybrid-pd up`` N times as a new user would, with a client at the door, and count stuck starts.

    python -m hybrid_pd.bench.start_loop --runs 20 --log-dir /tmp/start-loop --json start-loop.json

Each run starts ``hybrid-pd up --port P --log-dir DIR/run-N`` (the embedded model, 1 prefill + 1
decode worker), and a client that polls the router's ``/health`` every 0.5 s and, once it answers
200, sends one-token completions back to back through the router (what the issue's user did: the
decode worker serves them while the prefill worker is still starting). A run is **stuck** when
``up`` has not said ``hybrid-pd ready:`` within ``--stuck-after-s`` (240 s), or when a worker had
to be started again (``up`` logs ``exited code=...; starting it again``), or ``up`` exited. The run
is then stopped (SIGTERM, then SIGKILL of its process group) and the next one starts; the logs of
every run stay in its folder.

Per run it records the seconds to the router's first 200, to ``hybrid-pd ready:``, the worker
restarts, the one-token answers (200 and not), and why a stuck run was stuck. ``--code DIR`` runs
another checkout of the project (its ``hybrid_pd`` first on PYTHONPATH, same interpreter): the
code before a fix, from ``git worktree add``.

It also reports the longest silence of each of vLLM's start phases over every worker log of the runs
(:func:`longest_silences`, the phases of :mod:`hybrid_pd.worker.supervise`), which the CPU budgets are set by;
``--silences-only`` reads the logs under ``--log-dir`` (of this loop or any other, e.g. an e2e run's) and starts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from hybrid_pd.common.processes import free_port

__all__ = ["Run", "longest_silences", "one_start", "main"]

READY = "hybrid-pd ready:"
# The times on a start's lines: the worker's own (2026-11-27 03:34:39,370), vLLM's (INFO 11-27 03:35:18), torch's (W1127 03:35:17.615).
_STAMPS = (
    re.compile(r"^\d{4}-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)"),
    re.compile(r" (?:DEBUG|INFO|WARNING|ERROR) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) "),
    re.compile(r"^[WIE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)"),
)
RESTART = re.compile(r"(\S+) exited code=\S+: .*starting it again")


@dataclass
class Run:
    """One start of ``hybrid-pd up``: what the client and ``up`` saw, in seconds since ``up`` was started."""

    index: int
    log_dir: str
    health_200_s: float | None = None
    ready_s: float | None = None
    restarts: list[str] = field(default_factory=list)  # the worker of each restart `up` logged
    answered: int = 0  # one-token completions answered 200
    failed: int = 0  # ... answered otherwise, or not at all
    stuck: str | None = None  # why the run counts as stuck; None: it started

    @property
    def ok(self) -> bool:
        return self.stuck is None


class _Client:
    """Polls the router's /health; once it answers 200, sends one-token completions until stopped."""

    def __init__(self, url: str, started: float, run: Run) -> None:
        self.url, self.started, self.run = url, started, run
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="start-loop-client", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        model = None
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                try:
                    if self.run.health_200_s is None:
                        if client.get(self.url + "/health").status_code == 200:
                            self.run.health_200_s = round(time.monotonic() - self.started, 1)
                        else:
                            self.stop.wait(0.5)
                        continue
                    model = model or client.get(self.url + "/v1/models").json()["data"][0]["id"]
                    body = {"model": model, "prompt": "The weather today is", "max_tokens": 1, "temperature": 0}
                    if client.post(self.url + "/v1/completions", json=body).status_code == 200:
                        self.run.answered += 1
                    else:
                        self.run.failed += 1
                        self.stop.wait(0.2)
                except (httpx.HTTPError, KeyError, IndexError, ValueError):
                    if self.run.health_200_s is not None:
                        self.run.failed += 1
                    self.stop.wait(0.5)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM ``up`` (it stops its services), SIGKILL its whole process group if it takes over 120 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything `up` left behind (it runs in a group of its own)
    except ProcessLookupError:
        pass
    proc.wait()


def one_start(index: int, log_dir: Path, stuck_after_s: float, code: Path | None = None) -> Run:
    """Start ``hybrid-pd up`` once with a client at the door, until it is ready or counts as stuck; stop it."""
    run_dir = log_dir / f"run-{index:02d}"
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "hybrid_pd.cli", "up", "--port", str(port), "--log-dir", str(run_dir)]
    run = Run(index, str(run_dir))
    started = time.monotonic()
    with open(run_dir / "up.out", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=code or None, start_new_session=True)
    client = _Client(f"http://127.0.0.1:{port}", started, run)
    try:
        while True:
            text = (run_dir / "up.out").read_text(errors="replace")
            run.restarts = [m.group(1) for m in RESTART.finditer(text)]
            if run.restarts:
                run.stuck = f"{run.restarts[0]} was started again: {RESTART.search(text).group(0)[:300]}"
            elif READY in text:
                run.ready_s = round(time.monotonic() - started, 1)
            elif proc.poll() is not None:
                run.stuck = f"hybrid-pd up exited {proc.returncode} before it was ready"
            elif time.monotonic() - started > stuck_after_s:
                run.stuck = f"not ready within {stuck_after_s:.0f} s"
            if run.ready_s is not None or run.stuck is not None:
                break
            time.sleep(0.5)
        if run.ok:
            time.sleep(2)  # a few answers through the ready stack
    finally:
        client.stop.set()
        client.thread.join(35)
        _stop(proc)
    return run


def _stamp(line: str) -> int | None:
    """Seconds (within a year, to the second) at which a log line was written, None where it has no time."""
    for pattern in _STAMPS:
        if m := pattern.search(line):
            month, day, hour, minute, second = map(int, m.groups())
            return (((month * 31 + day) * 24 + hour) * 60 + minute) * 60 + second
    return None


def longest_silences(logs: list[Path]) -> dict[str, tuple[int, str]]:
    """Per start phase, the longest time between two lines of a start that show progress, and the log line that ended it.

    A start runs from the worker's ``starting vLLM`` line to its ``ready`` or ``vLLM ended`` line; a silence belongs to
    the phase the start was in while it lasted. Lines without a time (progress bars) are skipped.
    """
    from hybrid_pd.worker.supervise import START_PHASES, WAITING_LINES, start_phase

    longest: dict[str, tuple[int, str]] = {p.name: (0, "") for p in START_PHASES}
    for log in logs:
        phase, last = None, None
        for line in log.read_text(errors="replace").splitlines():
            if "starting vLLM role=" in line:
                phase, last = 0, _stamp(line)
                continue
            if phase is None or any(mark in line for mark in WAITING_LINES):
                continue
            if "hybrid_pd.worker [-] ready role=" in line or "vLLM ended (" in line:
                phase = None
                continue
            if (at := _stamp(line)) is not None and last is not None:
                name = START_PHASES[phase].name
                if at - last > longest[name][0]:
                    longest[name] = (at - last, f"{log}: {line[:160]}")
            phase = start_phase(phase, line)
            last = at if at is not None else last
    return longest


def summary(runs: list[Run]) -> dict[str, object]:
    """The stuck-start rate and the times to ready of the runs that started."""
    ready = [r.ready_s for r in runs if r.ok and r.ready_s is not None]
    return {
        "runs": len(runs),
        "stuck": sum(not r.ok for r in runs),
        "ready_s": {"min": min(ready), "median": statistics.median(ready), "max": max(ready)} if ready else None,
        "answered": sum(r.answered for r in runs),
        "failed": sum(r.failed for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="starts of hybrid-pd up (default 20)")
    parser.add_argument("--stuck-after-s", type=float, default=240.0, help="a start not ready after this long is stuck (default 240)")
    parser.add_argument("--log-dir", type=Path, required=True, help="each run's logs go into LOG_DIR/run-N")
    parser.add_argument("--code", type=Path, help="another checkout of the project to run (first on PYTHONPATH)")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    parser.add_argument("--silences-only", action="store_true", help="only report the start phases' silences in the logs under --log-dir")
    args = parser.parse_args(argv)
    if args.silences_only:
        _print_silences(args.log_dir)
        return 0
    runs: list[Run] = []
    for i in range(args.runs):
        run = one_start(i, args.log_dir, args.stuck_after_s, args.code)
        runs.append(run)
        state = f"ready {run.ready_s:.1f} s" if run.ok else f"STUCK: {run.stuck}"
        print(f"run {i:2d}: router 200 at {run.health_200_s} s, {state}, answers {run.answered} ok / {run.failed} not", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"summary": summary(runs), "runs": [asdict(r) for r in runs]}, indent=1) + "\n")
    print(json.dumps(summary(runs)), flush=True)
    _print_silences(args.log_dir)
    return 0


def _print_silences(log_dir: Path) -> None:
    logs = sorted(p for p in log_dir.rglob("*.log") if p.name.split("-")[0] in ("prefill", "decode", "colocated", "flex"))
    starts = sum(p.read_text(errors="replace").count("starting vLLM role=") for p in logs)
    print(f"longest silence of each start phase over {starts} starts in {len(logs)} worker logs:")
    for name, (seconds, line) in longest_silences(logs).items():
        print(f"  {seconds:4d} s  {name}" + (f"  (ended by {line})" if line else ""))


if __name__ == "__main__":
    sys.exit(main())
