"""Whether a worker's vLLM still works, decided from /proc, its output and its HTTP server.

Why this exists (issue #27): vLLM does not always notice its own faults. A model-worker process
died during start-up, left a zombie of its engine core, and the engine core logged "No available
shared memory broadcast block found in 60 seconds" for ten minutes while the worker service waited
for a /health that never came. A worker that hangs is not one that exited, so neither
``hybrid-pd up`` nor Compose nor Kubernetes restarted it. Here the worker service watches all of
vLLM's process group and its progress, and ends vLLM the moment one of these holds:

- a process of vLLM's that lives as long as vLLM (its API server, the worker's child, and every
  process vLLM names ``VLLM::...``: engine core, model workers) dies: exits, is killed, or is left a
  zombie. Short-lived helpers (multiprocessing's resource tracker, compiler subprocesses, probes)
  may come and go: they are not watched;
- one of those processes stays stopped (SIGSTOP) for the phase's window;
- while starting: the phase vLLM's start is in (:data:`START_PHASES`: read from the lines that begin
  each) prints nothing for its own budget on this device (lines that only say vLLM is waiting for another
  process do not count; ``start_stall_s``, where set, is every phase's budget), or vLLM is not ready after
  ``ready_timeout_s``;
- while serving: /health does not answer 200 for ``serve_stall_s``, or vLLM's /metrics shows
  requests running or waiting and no engine progress for ``serve_stall_s``. vLLM sets those gauges at
  its engine steps, so a gauge can be stale on an idle engine: after half the window without
  progress a one-token request is sent, and its answer counts as progress. Requests only waiting
  for a remote KV transfer do not end a worker either: the probe runs beside them.

:func:`judge` decides, a pure function of the state so far and one :class:`Observation`;
:class:`OutputRelay` and :class:`HttpChecks` gather what observations hold. A stall (not only a death) is
flagged, and the worker logs the stacks of :func:`long_lived` processes before ending them (:mod:`hybrid_pd.worker.stacks`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO

from hybrid_pd.common.processes import Proc, describe_status
from hybrid_pd.common.prom import metric_sum

__all__ = [
    "Decision",
    "EngineLoad",
    "HttpChecks",
    "Observation",
    "OutputRelay",
    "START_PHASES",
    "StartPhase",
    "WatchState",
    "Windows",
    "engine_load",
    "judge",
    "long_lived",
    "watched",
]

# vLLM names its long-lived processes "<prefix>::<name>" (setproctitle; vllm.utils.system_utils).
TITLE_PREFIX = os.environ.get("VLLM_PROCESS_NAME_PREFIX", "VLLM") + "::"

# vLLM's line when one of its processes has waited 60 s for another over their shared-memory queue: while serving, a
# model worker that read no step for that long (the slower host's wedged prefill, docs/reliability.md).
ENGINE_WAIT_LINE = "No available shared memory broadcast block found"

# Lines vLLM repeats while it waits for another of its processes: they show no progress of their own.
# The first is what the engine core logged once a minute for ten minutes in issue #27.
WAITING_LINES = (
    ENGINE_WAIT_LINE,
    "core engine proc(s) to start",
    "core engine proc(s) to connect",
)

# vLLM lines after which it will never become ready, though its process lives on: the NIXL
# side-channel listener is a thread; when it dies (its port taken), the engine waits for it forever.
FATAL_LINES = ("Exception in thread nixl_handshake_listener",)

# Counters that move whenever vLLM's engine works: tokens computed, requests finished, KV blocks taken
# (a chunked prefill moves only the last until its first token).
PROGRESS_METRICS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:kv_cache_usage_perc",
)



@dataclass(frozen=True)
class StartPhase:
    """A step of vLLM's start, begun by a line it logs, with the longest silence it may keep on each device.

    ``cpu_s``: on the 2-core CPU machine the longest silence measured in a phase was 51 s (a new process's imports,
    seven vLLM servers starting at once; docs/reliability.md), the engine's own steps took seconds: 80 s ends a stuck
    start, its worker's stop included, within 90 s of its last line. ``cuda_s``: a
    GPU's phases print as they go too (progress bars of weights and CUDA graphs redraw, each torch.compile range is
    logged), but one range's compile or one large shard takes minutes: the 300 s window every phase had before.
    """

    name: str  # what vLLM is doing, as the verdict names it
    begins: tuple[str, ...]  # a line with one of these begins it (none: the first phase, begun by the spawn)
    cpu_s: float = 80.0
    cuda_s: float = 300.0

    def budget_s(self, device: str) -> float:
        return self.cpu_s if device == "cpu" else self.cuda_s


# vLLM 0.32's start, in order, as its lines show it (an API server, one engine core, its model workers). A phase is
# left for a later one only: a later phase's line that comes early (another worker's, a repeated one) moves it on.
START_PHASES = (
    StartPhase("starting its API server (imports, configuration)", ()),
    StartPhase("starting its engine core process", ("non-default args:",)),
    StartPhase("starting its model worker processes", ("Initializing a V1 LLM engine",)),
    StartPhase("loading the weights", ("Starting to load model",)),
    StartPhase(
        "profiling, allocating the KV cache and warming up (compile, registration)",
        ("Loading weights took", "Model loading took"),
    ),
    StartPhase("capturing CUDA graphs", ("Capturing CUDA graphs",)),
    StartPhase("starting its HTTP server", ("init engine (profile, create kv cache, warmup model) took",)),
    StartPhase("answering /health", ("Application startup complete",)),
)


def start_phase(index: int, line: str) -> int:
    """The start phase after ``line``, from phase ``index``: the latest one whose line it is, or ``index``."""
    for later in range(len(START_PHASES) - 1, index, -1):
        if any(mark in line for mark in START_PHASES[later].begins):
            return later
    return index


ProcKey = tuple[int, int]  # (pid, start time): a pid the kernel handed out again is another process


@dataclass(frozen=True)
class Windows:
    """How long each kind of silence may last (the worker's settings of the same names, and its device).

    ``start_stall_s``: every start phase's budget where set; None: each phase's own on ``device``.
    """

    start_stall_s: float | None
    serve_stall_s: float
    ready_timeout_s: float
    device: str = "cpu"

    def start_budget_s(self, phase: int) -> float:
        """How long start phase ``phase`` (an index of :data:`START_PHASES`) may print nothing."""
        return self.start_stall_s if self.start_stall_s is not None else START_PHASES[phase].budget_s(self.device)


@dataclass(frozen=True)
class EngineLoad:
    """One reading of vLLM's /metrics: requests its engine holds, and counters that move as it works."""

    requests: int
    progress: tuple[float, ...]


@dataclass(frozen=True)
class Observation:
    """What the worker service sees of its vLLM at one moment (monotonic seconds)."""

    at: float
    leader: int  # vLLM's API server, our child, whose pid is the group's id
    group: Mapping[int, Proc]  # every process of vLLM's group now, zombies included
    output_at: float  # when vLLM last printed something other than a waiting line
    phase: int = 0  # the start phase its lines so far show (an index of START_PHASES)
    leader_returncode: int | None = None  # the API server's exit code once we reaped it (Popen's sign convention)
    fatal_line: str | None = None
    ready_at: float | None = None  # when /health first answered 200
    health_ok_at: float | None = None  # when /health last answered 200
    engine: EngineLoad | None = None  # the latest /metrics reading
    probe_sent_at: float | None = None  # the latest one-token request, sent ...
    probe_answered_at: float | None = None  # ... and answered


@dataclass(frozen=True)
class WatchState:
    """What :func:`judge` remembers between observations."""

    spawned_at: float
    # Long-lived processes as last seen alive, each with the last title read: an exiting process's command
    # line reads empty before it is a zombie, and its parent may reap it before the next look.
    watched: Mapping[ProcKey, Proc] = field(default_factory=dict)
    stopped_since: Mapping[ProcKey, float] = field(default_factory=dict)
    engine: EngineLoad | None = None
    progress_at: float | None = None  # serving: the engine's last progress, or last time it held no request


@dataclass(frozen=True)
class Decision:
    """``failure``: why vLLM is ended (one line), None while it works; ``probe``: send a one-token request now.

    ``stalled``: the failure is (also) a process of vLLM's that lives but does not go on (silent, stopped, not
    ready, not answering, no engine progress), not only a death: the worker then logs where each process stands
    (:mod:`hybrid_pd.worker.stacks`) before ending it.
    """

    failure: str | None = None
    probe: bool = False
    stalled: bool = False


def watched(proc: Proc, leader: int) -> bool:
    """Whether a death of ``proc`` ends vLLM: its API server and the processes vLLM names, not helpers."""
    return proc.pid == leader or proc.title.startswith(TITLE_PREFIX)


def _name(proc: Proc, leader: int, seen: Mapping[int, Proc]) -> str:
    """vLLM's title of ``proc``; a zombie's command line is empty, so its title as last seen alive (``seen``, by pid)."""
    if proc.pid == leader:
        return "vLLM's API server"
    title = proc.title or (seen[proc.pid].title if proc.pid in seen else "")
    return title.split()[0] if title else "a process"


def _returncode_status(returncode: int) -> int:
    """Popen's exit code (negative: the signal) as the waitpid(2) status describe_status reads."""
    return -returncode if returncode < 0 else returncode << 8


def _death(before: Proc, obs: Observation, seen: Mapping[int, Proc]) -> str | None:
    """How a watched process ended, or None while it lives (``seen``: the watched processes as last seen alive, by pid)."""
    now = obs.group.get(before.pid)
    who = f"{_name(before, obs.leader, seen)} (pid {before.pid})"
    if now is not None and now.started == before.started:
        if not now.zombie:
            return None
        parent = obs.group.get(now.ppid)
        by = f" by {_name(parent, obs.leader, seen)} (pid {parent.pid})" if parent is not None else ""
        return f"{who} {describe_status(now.status)} and is left a zombie{by}"
    if before.pid == obs.leader and obs.leader_returncode is not None:
        return f"{who} {describe_status(_returncode_status(obs.leader_returncode))}"
    return f"{who} is gone; its parent reaped it before its exit status could be read"


def _track(
    state: WatchState, obs: Observation, window_s: float
) -> tuple[dict[ProcKey, Proc], dict[ProcKey, float], list[str], list[str]]:
    """The watched processes alive now, since when each stopped one is stopped, the deaths among them and those stopped too long."""
    failures, stalls = [], []
    alive: dict[ProcKey, Proc] = {}
    seen = {pid: proc for (pid, _), proc in state.watched.items()}
    for key, before in state.watched.items():
        if (how := _death(before, obs, seen)) is not None:
            failures.append(how)
        else:
            now = obs.group[before.pid]
            alive[key] = now if now.title else dataclasses.replace(now, title=before.title)
    for proc in obs.group.values():
        if not proc.zombie and watched(proc, obs.leader):
            alive.setdefault((proc.pid, proc.started), proc)
    stopped = {key: state.stopped_since.get(key, obs.at) for key, proc in alive.items() if proc.stopped}
    for key, since in stopped.items():
        if obs.at - since >= window_s:
            stalls.append(f"{_name(alive[key], obs.leader, seen)} (pid {key[0]}) has been stopped (SIGSTOP) for {obs.at - since:.0f} s")
    return alive, stopped, failures, stalls


def _engine(state: WatchState, obs: Observation, window_s: float) -> tuple[float | None, list[str], bool]:
    """Serving: the engine's last progress, the failure if it made none for the window with requests held, whether to probe."""
    reading = obs.engine
    progress_at = state.progress_at if state.progress_at is not None else obs.at
    if reading is None or reading.requests == 0 or state.engine is None or reading.progress != state.engine.progress:
        progress_at = obs.at
    if obs.probe_answered_at is not None and obs.probe_answered_at > progress_at:
        progress_at = obs.probe_answered_at
    still = obs.at - progress_at
    if reading is None or reading.requests == 0 or still < window_s / 2:
        return progress_at, [], False
    if still < window_s:
        return progress_at, [], obs.probe_sent_at is None or obs.probe_sent_at < progress_at
    unanswered = (
        f", nor an answer to a one-token request sent {obs.at - obs.probe_sent_at:.0f} s ago"
        if obs.probe_sent_at is not None and obs.probe_sent_at >= progress_at
        else ""
    )
    return progress_at, [f"{reading.requests} request(s) running or waiting and no engine progress for {still:.0f} s{unanswered}"], False


def judge(state: WatchState, obs: Observation, windows: Windows) -> tuple[WatchState, Decision]:
    """The state after ``obs`` and what to do: end vLLM (why, one line), probe it, or nothing."""
    serving = obs.ready_at is not None
    window_s = windows.serve_stall_s if serving else windows.start_budget_s(obs.phase)
    alive, stopped, failures, stalls = _track(state, obs, window_s)
    if not serving:  # a process stopped mid-start: in which phase, and its budget
        stalls = [f"{stall} while {START_PHASES[obs.phase].name} (the phase's budget: {window_s:.0f} s)" for stall in stalls]
    if obs.fatal_line is not None:
        failures.insert(0, f"vLLM failed and will not become ready: {obs.fatal_line}")
    probe = False
    progress_at = state.progress_at
    if not serving:
        silent = obs.at - max(obs.output_at, state.spawned_at)
        if silent >= window_s:
            phase = START_PHASES[obs.phase].name
            stalls.append(f"vLLM's start stuck {phase}: it printed nothing and did not answer /health for {silent:.0f} s "
                          f"since its last line (the phase's budget: {window_s:.0f} s)")  # fmt: skip
        elif obs.at - state.spawned_at >= windows.ready_timeout_s:
            stalls.append(f"vLLM did not become ready within {windows.ready_timeout_s:.0f} s")
    else:
        healthy_at = max(obs.health_ok_at or 0.0, obs.ready_at or 0.0)
        if obs.at - healthy_at >= windows.serve_stall_s:
            stalls.append(f"vLLM's /health has not answered 200 for {obs.at - healthy_at:.0f} s")
        progress_at, engine_stalls, probe = _engine(state, obs, windows.serve_stall_s)
        stalls += engine_stalls
    failures += stalls
    new = dataclasses.replace(state, watched=alive, stopped_since=stopped, engine=obs.engine, progress_at=progress_at)
    return new, Decision("; ".join(failures) or None, probe and not failures, stalled=bool(stalls))


def long_lived(group: Mapping[int, Proc], leader: int) -> list[tuple[str, Proc]]:
    """vLLM's processes whose stacks say where it stands, by name: its API server, then the ones it names, oldest first."""
    procs = sorted((p for p in group.values() if not p.zombie and watched(p, leader)), key=lambda p: (p.pid != leader, p.started, p.pid))
    return [(_name(p, leader, {}), p) for p in procs]


def engine_load(metrics_text: str) -> EngineLoad:
    """vLLM's /metrics as an :class:`EngineLoad`."""
    requests = metric_sum(metrics_text, "vllm:num_requests_running") + metric_sum(metrics_text, "vllm:num_requests_waiting")
    return EngineLoad(round(requests), tuple(metric_sum(metrics_text, name) for name in PROGRESS_METRICS))


_ATTENTION_BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")


def logged_attention_block(text: str) -> int | None:
    """The attention block vLLM's engine logged it chose for a hybrid (the last one logged), None where it logged none."""
    found = _ATTENTION_BLOCK.findall(text)
    return int(found[-1]) if found else None


class OutputRelay:
    """Copies vLLM's output to ours as it comes, keeps its last lines, and notes when it last showed progress.

    Reads whatever bytes are there, not whole lines: a progress bar that redraws itself with
    carriage returns (loading weights, capturing CUDA graphs) shows progress before its newline.
    """

    def __init__(self, stream: IO[bytes], tail_lines: int = 400) -> None:
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.output_at = time.monotonic()
        self.phase = 0  # the start phase vLLM's lines so far show (START_PHASES)
        self.fatal_line: str | None = None
        self.engine_waits = 0  # times vLLM said a process of its own waited 60 s for another (ENGINE_WAIT_LINE)
        # The attention block the engine chose for a hybrid ("Setting attention block size to N tokens"): where its
        # prefix-cache hits land, which its API server's metrics do not show (hybrid_pd.common.prom.prefix_hit_tokens).
        self.attention_block: int | None = None
        self._stream = stream
        self._thread = threading.Thread(target=self._run, name="vllm-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending = b""
        out = getattr(sys.stdout, "buffer", None)
        while chunk := self._stream.read1(65536):  # type: ignore[attr-defined]
            if out is not None:
                out.write(chunk)
                out.flush()
            else:  # a text stream without bytes underneath (a test's capture)
                sys.stdout.write(chunk.decode(errors="replace"))
            *lines, pending = (pending + chunk).split(b"\n")
            progress = redrawing = b"\r" in pending  # a progress bar redrawn in place
            if (redrawn := pending.rfind(b"\r", 0, len(pending) - 1)) >= 0:
                pending = pending[redrawn + 1 :]  # what a terminal would show of it
            for raw in lines:
                line = raw.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode(errors="replace")  # a redrawn bar's last state
                self.tail.append(line)
                self.phase = start_phase(self.phase, line)
                if line.startswith(FATAL_LINES) and self.fatal_line is None:
                    self.fatal_line = line
                self.engine_waits += ENGINE_WAIT_LINE in line
                self.attention_block = logged_attention_block(line) or self.attention_block
                progress = progress or not any(mark in line for mark in WAITING_LINES)
            if redrawing:  # a bar being redrawn begins its phase before its newline (CUDA graphs)
                self.phase = start_phase(self.phase, pending.decode(errors="replace"))
            if progress:
                self.output_at = time.monotonic()

    def join(self, timeout_s: float) -> None:
        """Wait until vLLM's output ends (every process that holds it closed it) or ``timeout_s`` passes."""
        self._thread.join(timeout_s)


class HttpChecks:
    """Asks vLLM's HTTP server, from a thread of its own: /health, then /metrics, and one-token requests when asked.

    Before it is ready /health is asked every half second (as the wait for readiness always
    did); afterwards every ``interval_s``. Results are times (monotonic) read by the supervising loop.
    """

    def __init__(self, url: str, model: str, interval_s: float, request_timeout_s: float) -> None:
        self.url, self.model = url, model
        self.interval_s, self.request_timeout_s = interval_s, request_timeout_s
        self.ready_at: float | None = None
        self.health_ok_at: float | None = None
        self.engine: EngineLoad | None = None
        self.probe_sent_at: float | None = None
        self.probe_answered_at: float | None = None
        self._probing = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-checks", daemon=True)
        self._thread.start()

    def _get(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.request_timeout_s) as resp:
                return resp.read().decode() if resp.status == 200 else None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            ok = self._get("/health") is not None
            if ok:
                self.health_ok_at = time.monotonic()
                self.ready_at = self.ready_at or self.health_ok_at
            if self.ready_at is not None and (text := self._get("/metrics")) is not None:
                self.engine = engine_load(text)
            self._stop.wait(self.interval_s if self.ready_at is not None else 0.5)

    def probe(self) -> None:
        """Send one one-token request in the background unless one is under way; its answer sets ``probe_answered_at``."""
        if self._probing.acquire(blocking=False):
            self.probe_sent_at = time.monotonic()
            threading.Thread(target=self._probe, name="vllm-probe", daemon=True).start()

    def _probe(self) -> None:
        """Token id 0 exists in every vocabulary; a request without kv_transfer_params is a local one on any role."""
        body = json.dumps({"model": self.model, "prompt": [0], "max_tokens": 1, "temperature": 0}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=3600) as resp:  # the window decides, not this timeout
                if resp.status == 200:
                    self.probe_answered_at = time.monotonic()
        except (urllib.error.URLError, OSError, ValueError):
            pass
        finally:
            self._probing.release()

    def stop(self) -> None:
        self._stop.set()
