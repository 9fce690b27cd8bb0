"""A decode engine waiting for a pull looks again after 100 us, not 1 ms: the decode row is scheduled sooner.

While a request waits for its state (``WAITING_FOR_REMOTE_KVS``) and nothing else runs, vLLM's engine loop
(``EngineCoreProc._process_engine_step``, ``vllm/v1/engine/core.py``, 0.26 and 0.32) steps without running the model and
then sleeps 1 ms, so background threads (NIXL's handshake) get the GIL. Under vLLM's default asynchronous scheduling
the engine learns a pull finished one step after the step that saw it, and schedules the decode row one step later:
two of those sleeps lie between the read completing and the decode row (on an H100 and an H200, "pull done ->
decode-row step scheduled" was 2.9-3.2 ms p50 at one request in flight, docs/performance.md). A step that runs the
model does not sleep, so the cut acts only on an engine with nothing else to do: no running request waits for it.

The shorter sleep still gives up the GIL every turn. What it costs is the engine's core: an engine that waits for a
pull, or on a flexible worker for a decode worker to read the state it holds, steps about ten times as often while it
waits. Our launch names the fix for decode and flexible workers on GPUs (:func:`hybrid_pd.connector.launch.engine_fix_env`),
not on CPU, where the engine's core is the model's too.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

__all__ = ["DOES", "IDLE_SLEEP_S", "VLLM_IDLE_SLEEP_S", "EngineTime", "apply", "probe"]

VLLM_IDLE_SLEEP_S = 0.001  # what vLLM's engine loop sleeps after a step that ran no model
IDLE_SLEEP_S = 100e-6
DOES = f"it sleeps {IDLE_SLEEP_S * 1e6:g} us instead"


class EngineTime:
    """The ``time`` module as vLLM's engine module sees it once fixed: its idle sleep shortened, everything else as is."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(IDLE_SLEEP_S if seconds == VLLM_IDLE_SLEEP_S else seconds)


def probe() -> str | None:
    """Why this vLLM needs the fix (its engine loop sleeps 1 ms after a step that ran no model), or None."""
    from vllm.v1.engine import core

    if core.time is not time:  # already fixed, or vLLM's module no longer uses the time module as is
        return None
    try:
        source = inspect.getsource(core.EngineCoreProc._process_engine_step)
    except (AttributeError, OSError, TypeError):
        return None
    return "vLLM's engine sleeps 1 ms after each step that ran no model" if f"time.sleep({VLLM_IDLE_SLEEP_S})" in source else None


def apply() -> None:
    """vLLM's engine module sleeps :data:`IDLE_SLEEP_S` where it slept :data:`VLLM_IDLE_SLEEP_S`."""
    from vllm.v1.engine import core

    core.time = EngineTime()
