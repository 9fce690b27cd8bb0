"""The hand-off timeline's trace: when each layer saw each step of a P/D request, as JSON lines.

A P/D request crosses three kinds of process: the router, a prefill worker and a decode
worker (each a vLLM HTTP server and its engine). Each process that is traced appends its
own file, ``<dir>/timeline-<source>-<pid>.jsonl``, so no process waits on another;
``hybrid_pd/bench/timeline.py`` joins the files by request id into per-request segments.

The first line of a file names the process, every later line is one event::

    {"process": {"source": "decode", "host": "gpu-3", "pid": 4242}}
    {"ev": "pull_done", "req": "cmpl-abc-0-9f1e2d3c", "mono": 81234.5671, "wall": 1767000000.1234}

- ``source``: ``router``, ``prefill`` or ``decode``; a request's prefill and decode legs
  carry the same request id, the source tells them apart.
- ``rid``: the router's id of the leg (its ``X-Request-Id``), or ``req``: vLLM's own id of
  the request inside one engine. vLLM renames a request (``cmpl-<rid>-<i>-<hex>``, versions
  differ), so the engine learns the router's id from the leg's ``kv_transfer_params``
  (:data:`REQUEST_ID_PARAM`) and writes both once; events of the engine's model workers,
  which see only vLLM's id, join through that.
- ``mono``: ``time.monotonic()`` of this process (vLLM's own engine timestamps are on that
  clock too), for durations between events of one process; ``wall``: the same instant on
  ``time.time()``, only to put events of different processes on one line. ``wall`` is
  ``mono`` plus this process's offset between the two clocks (:class:`_Clock`), so the two
  agree within a process and a join that mixes them adds up. Hosts' wall clocks differ by
  their NTP error, which goes into the segments that cross from one host to another. An
  event taken from another process's wall clock (vLLM's ``arrival_time``) has no ``mono``.

Writing is off unless a directory is given; one event costs a line of JSON and its write
(5-8 us on a busy 2-vCPU VM), so a P/D request costs the router about 40 us (six events).
A trace that cannot be written is lost, never the request.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from json.encoder import encode_basestring_ascii as _quote
from pathlib import Path

from hybrid_pd.connector.contract import TIMELINE_DIR_ENV, TIMELINE_SOURCE_ENV

__all__ = ["REQUEST_ID_PARAM", "SOURCES", "TimelineWriter", "from_env", "writer_for"]

# What a vLLM process learns from our launch (hybrid_pd/connector/launch.py): where to write and what it is.

# The key of a leg's kv_transfer_params that carries the router's request id into the engine.
REQUEST_ID_PARAM = "hybrid_pd_request_id"

SOURCES = ("router", "prefill", "decode")

log = logging.getLogger("hybrid_pd.timeline")


class _Clock:
    """``time.time() - time.monotonic()`` of this process, measured again at most once a second.

    Read from the tightest of three back-to-back readings: a thread switch between the
    two clock reads of one (vLLM's engine has several threads) would shift every event
    written with it by the switch's length.
    """

    def __init__(self) -> None:
        self._offset = 0.0
        self._measured_at = float("-inf")

    def wall(self, mono: float) -> float:
        if mono - self._measured_at > 1.0:
            width, offset = float("inf"), 0.0
            for _ in range(3):
                before, wall, after = time.monotonic(), time.time(), time.monotonic()
                if after - before < width:
                    width, offset = after - before, wall - (before + after) / 2
            self._offset, self._measured_at = offset, mono
        return mono + self._offset


class TimelineWriter:
    """Appends one process's timeline events to its own file (thread-safe: vLLM's engine has several threads)."""

    def __init__(self, directory: str | Path, source: str) -> None:
        if source not in SOURCES:
            raise ValueError(f"timeline source must be one of {SOURCES}, got {source!r}")
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._out = open(path / f"timeline-{source}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the process
        self._lock = threading.Lock()
        self._failed = False
        self._clock = _Clock()
        self._append(json.dumps({"process": {"source": source, "host": socket.gethostname(), "pid": os.getpid()}}) + "\n")

    def event(self, name: str, *, rid: str | None = None, req: str | None = None, mono: float | None = None, wall: float | None = None) -> None:
        """Record event ``name`` of request ``rid`` (the router's id) and/or ``req`` (vLLM's).

        At this moment unless a time is given: ``mono`` alone (a ``time.monotonic()`` of this
        process, such as vLLM's engine timestamps) gets its wall time from this process's
        clock offset; ``wall`` alone (another process's ``time.time()``) stays without ``mono``.
        """
        if mono is None and wall is None:
            mono = time.monotonic()
        if wall is None:
            wall = self._clock.wall(mono)
        # Written by hand, not json.dumps (a third of the cost): names are ours, ids are escaped, floats are JSON.
        text = f'{{"ev":{_quote(name)}'
        if rid is not None:
            text += f',"rid":{_quote(rid)}'
        if req is not None:
            text += f',"req":{_quote(req)}'
        if mono is not None:
            text += f',"mono":{float(mono)!r}'
        self._append(f'{text},"wall":{float(wall)!r}}}\n')

    def _append(self, text: str) -> None:
        try:
            with self._lock:
                self._out.write(text)
        except OSError as exc:
            if not self._failed:
                log.warning("timeline: cannot record an event (%s); later failures are not logged", exc)
            self._failed = True


def writer_for(directory: str, source: str) -> TimelineWriter:
    """This process's writer for ``source`` into ``directory`` (one file per process, however often asked).

    Keyed by the process id too: a process forked after its parent made a writer (vLLM may
    fork its engine from its HTTP server) gets a file, and a clock, of its own.
    """
    return _writer(directory, source, os.getpid())


@functools.cache
def _writer(directory: str, source: str, pid: int) -> TimelineWriter:
    return TimelineWriter(directory, source)


def from_env() -> TimelineWriter | None:
    """The writer a vLLM process was launched with (:data:`TIMELINE_DIR_ENV`, :data:`TIMELINE_SOURCE_ENV`); None: off."""
    directory, source = os.environ.get(TIMELINE_DIR_ENV), os.environ.get(TIMELINE_SOURCE_ENV)
    if not directory or not source:
        return None
    return writer_for(directory, source)
