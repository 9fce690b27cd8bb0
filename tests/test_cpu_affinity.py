"""The model worker's thread goes back to its cores after vLLM's NIXL connector moved it (hybrid_pd.connector.vllm.cpu_affinity).

Each test runs in a thread of its own: affinity is per thread, and pytest's must stay as it was.
A real stack's model workers are checked in tests/e2e/test_up_cli.py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import pytest

from hybrid_pd.connector.vllm.cpu_affinity import kept_affinity

CORES = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to move a thread between")


def _in_a_thread(body: Callable[[], object]) -> object:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


def test_a_thread_moved_to_the_last_core_inside_goes_back_to_its_own(caplog):
    """What vLLM 0.32's connector worker does on CPU: sched_setaffinity(0, [last core of the node])."""
    first, last = CORES[0], CORES[-1]

    def body() -> tuple[set[int], set[int]]:
        os.sched_setaffinity(0, {first})  # where OpenMP bound the model's thread
        with kept_affinity("vLLM's NIXL connector worker"):
            os.sched_setaffinity(0, {last})
            inside = os.sched_getaffinity(0)
        return inside, os.sched_getaffinity(0)

    with caplog.at_level(logging.INFO, logger="vllm.hybrid_pd.cpu_affinity"):
        inside, after = _in_a_thread(body)
    assert inside == {last}
    assert after == {first}
    assert f"vLLM's NIXL connector worker moved the model's thread to cores {last}; put it back on cores {first}" in caplog.text


def test_a_thread_left_where_it_was_is_not_touched_and_nothing_is_logged(caplog):
    def body() -> set[int]:
        os.sched_setaffinity(0, set(CORES[:2]))
        with kept_affinity("vLLM's NIXL connector worker"):
            pass
        return os.sched_getaffinity(0)

    with caplog.at_level(logging.INFO, logger="vllm.hybrid_pd.cpu_affinity"):
        assert _in_a_thread(body) == set(CORES[:2])
    assert "moved" not in caplog.text


def test_a_thread_started_inside_keeps_the_core_it_was_given():
    """NIXL's threads that vLLM's connector starts while the model's thread is moved stay where vLLM put them."""
    first, last = CORES[0], CORES[-1]

    def body() -> tuple[set[int], set[int]]:
        os.sched_setaffinity(0, {first})
        seen: dict[str, set[int]] = {}
        started, finish = threading.Event(), threading.Event()

        def helper() -> None:
            started.set()
            finish.wait(10)
            seen["helper"] = os.sched_getaffinity(0)

        with kept_affinity("vLLM's NIXL connector worker"):
            os.sched_setaffinity(0, {last})
            thread = threading.Thread(target=helper)
            thread.start()
            started.wait(10)
        finish.set()
        thread.join()
        return os.sched_getaffinity(0), seen["helper"]

    assert _in_a_thread(body) == ({first}, {last})
