"""Where a stalled vLLM stuck: hybrid_pd.worker.stacks dumps real processes' Python stacks with py-spy, or says why not."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from hybrid_pd.common.processes import Proc, process_group
from hybrid_pd.worker.stacks import dump_stacks, py_spy

pytestmark = pytest.mark.skipif(py_spy() is None, reason="py-spy is a dependency of the worker extras (pip install py-spy)")

STUCK = """
import sys, time
def waiting_for_a_model_worker_that_never_answers():
    print("ready", flush=True)
    time.sleep(600)
waiting_for_a_model_worker_that_never_answers()
"""


def _proc(pid: int) -> Proc:
    return process_group(pid)[pid]


@pytest.fixture
def stuck() -> Iterator[subprocess.Popen]:
    """A Python process asleep in a named function, the leader of its own group (as vLLM is)."""
    child = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline() == "ready\n"
        yield child
    finally:
        child.kill()
        child.wait()


def test_the_dump_names_the_frame_a_sleeping_process_is_stuck_in(stuck):
    out = dump_stacks([("VLLM::EngineCore", _proc(stuck.pid))], timeout_s=20)
    assert out.startswith(f"--- VLLM::EngineCore (pid {stuck.pid}):\n")
    assert "waiting_for_a_model_worker_that_never_answers (<string>:5)" in out, out


def test_a_stopped_process_is_continued_to_read_where_it_stood(stuck):
    stuck.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not _proc(stuck.pid).stopped and time.monotonic() < deadline:
        time.sleep(0.05)
    out = dump_stacks([("VLLM::Worker", _proc(stuck.pid))], timeout_s=20)
    assert f"--- VLLM::Worker (pid {stuck.pid}), stopped (SIGSTOP): continued to read its stack:" in out
    assert "waiting_for_a_model_worker_that_never_answers" in out, out


def test_a_dump_that_fails_says_why_and_the_next_one_is_still_taken(stuck):
    """A process py-spy cannot read (not Python here; elsewhere no permission to trace it) takes one line."""
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        out = dump_stacks([("VLLM::Worker", _proc(sleeper.pid)), ("VLLM::EngineCore", _proc(stuck.pid))], timeout_s=20)
    finally:
        sleeper.kill()
        sleeper.wait()
    first, rest = out.split("\n", 1)
    assert first.startswith(f"--- VLLM::Worker (pid {sleeper.pid}):")
    assert rest.startswith("py-spy dump failed (exit 1): "), out
    assert "waiting_for_a_model_worker_that_never_answers" in rest


def test_without_py_spy_each_process_gets_a_line_that_says_so(stuck, tmp_path):
    missing = str(tmp_path / "py-spy")
    out = dump_stacks([("VLLM::Worker", _proc(stuck.pid))], timeout_s=5, tool=missing)
    assert out.startswith(f"--- VLLM::Worker (pid {stuck.pid}):\npy-spy could not run: ")


def test_a_dump_that_takes_too_long_is_given_up(stuck, tmp_path):
    slow = tmp_path / "py-spy"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    started = time.monotonic()
    out = dump_stacks([("VLLM::Worker", _proc(stuck.pid))], timeout_s=1, tool=str(slow))
    assert time.monotonic() - started < 10
    assert out.endswith("py-spy dump took longer than 1 s")
