"""The model worker's thread stays on its cores while vLLM's NIXL connector is built (hybrid_pd.connector.vllm.cpu_affinity).

Each test runs in a thread of its own: affinity is per thread, and pytest's must stay as it was.
A real stack's model workers are checked in tests/e2e/test_up_cli.py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import psutil
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


def test_vllms_move_of_the_thread_to_the_last_core_is_not_carried_out(caplog):
    """What vLLM 0.32's connector worker does on CPU: sched_setaffinity(0, [last core of the node]). The rest of its
    constructor ran on that core, where a start was starved (issue #36): the thread never goes there now."""
    first, last = CORES[0], CORES[-1]

    def body() -> tuple[set[int], set[int]]:
        os.sched_setaffinity(0, {first})  # where OpenMP bound the model's thread
        with kept_affinity("vLLM's NIXL connector worker"):
            os.sched_setaffinity(0, {last})
            inside = os.sched_getaffinity(0)
        return inside, os.sched_getaffinity(0)

    with caplog.at_level(logging.INFO, logger="vllm.hybrid_pd.cpu_affinity"):
        inside, after = _in_a_thread(body)
    assert inside == {first}
    assert after == {first}
    assert f"vLLM's NIXL connector worker asked to move the model's thread to cores {last}; kept it on cores {first}" in caplog.text
    assert os.sched_setaffinity.__module__ == "posix", "os's own function is back"


def test_a_move_made_otherwise_is_undone_and_other_threads_moves_are_carried_out(caplog):
    first, last = CORES[0], CORES[-1]

    def body() -> tuple[set[int], set[int]]:
        os.sched_setaffinity(0, {first})
        other: dict[str, set[int]] = {}

        def elsewhere() -> None:
            os.sched_setaffinity(0, {last})
            other["cores"] = os.sched_getaffinity(0)

        with kept_affinity("vLLM's NIXL connector worker"):
            psutil.Process(threading.get_native_id()).cpu_affinity([last])  # not through os.sched_setaffinity
            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join()
        return os.sched_getaffinity(0), other["cores"]

    with caplog.at_level(logging.INFO, logger="vllm.hybrid_pd.cpu_affinity"):
        assert _in_a_thread(body) == ({first}, {last})
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


def test_a_thread_started_inside_gets_the_cores_of_the_model_thread():
    """NIXL's threads that vLLM's connector starts run on the model worker's cores, not on the last core."""
    first, last = CORES[0], CORES[-1]

    def body() -> tuple[set[int], set[int]]:
        os.sched_setaffinity(0, {first})
        seen: dict[str, set[int]] = {}

        def helper() -> None:
            seen["helper"] = os.sched_getaffinity(0)

        with kept_affinity("vLLM's NIXL connector worker"):
            os.sched_setaffinity(0, {last})
            thread = threading.Thread(target=helper)
            thread.start()
            thread.join()
        return os.sched_getaffinity(0), seen["helper"]

    assert _in_a_thread(body) == ({first}, {first})
