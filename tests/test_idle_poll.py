"""An engine waiting for a pull looks again after 100 us, not vLLM's 1 ms (hybrid_pd/connector/vllm/idle_poll.py).

vLLM's own engine loop, ``EngineCoreProc._process_engine_step``, run on an engine with a request waiting and no model
run: the sleep it asks for before and after the fix. What it saves on a GPU is measured in docs/performance.md.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from hybrid_pd.connector.vllm import idle_poll


def _engine(model_executed: bool) -> SimpleNamespace:
    """What ``_process_engine_step`` touches of vLLM's engine: a step that ran the model or not, a request still there."""
    return SimpleNamespace(
        step_fn=lambda: ({}, model_executed),
        output_queue=SimpleNamespace(put_nowait=lambda _: None),
        post_step=lambda _: None,
        scheduler=SimpleNamespace(has_requests=lambda: True, has_unfinished_requests=lambda: True),
    )


def _sleeps(monkeypatch, engine: SimpleNamespace) -> list[float]:
    from vllm.v1.engine.core import EngineCoreProc

    slept: list[float] = []
    with monkeypatch.context() as patch:  # undoes only the recorder, not the test's own patches
        patch.setattr(time, "sleep", slept.append)
        EngineCoreProc._process_engine_step(engine)
    return slept


def test_vllms_engine_loop_sleeps_100_us_instead_of_1_ms_after_a_step_that_ran_no_model(monkeypatch):
    from vllm.v1.engine import core

    monkeypatch.setattr(core, "time", core.time)  # restored after the test
    assert _sleeps(monkeypatch, _engine(model_executed=False)) == [idle_poll.VLLM_IDLE_SLEEP_S]  # vLLM's own
    assert idle_poll.probe() is not None
    idle_poll.apply()
    assert idle_poll.probe() is None  # applied once
    assert _sleeps(monkeypatch, _engine(model_executed=False)) == [idle_poll.IDLE_SLEEP_S]
    assert _sleeps(monkeypatch, _engine(model_executed=True)) == []  # a step that ran the model never slept
    assert isinstance(core.time, idle_poll.EngineTime)  # still fixed here: the checks above ran on the fixed module
    assert core.time.monotonic is time.monotonic  # the rest of the module is the time module's


def test_every_other_sleep_is_left_as_asked(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    idle_poll.EngineTime.sleep(0.5)
    idle_poll.EngineTime.sleep(idle_poll.VLLM_IDLE_SLEEP_S)
    assert slept == [0.5, idle_poll.IDLE_SLEEP_S]
