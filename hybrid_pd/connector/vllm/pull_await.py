"""Notice a pull complete in the engine step that posted it, not a step later.

vLLM's NIXL worker posts a pull's reads in ``start_load_kv`` and looks at them once per
engine step, in ``get_transfer_results`` (0.32) / ``get_finished`` (0.26), at the end of
the same step: microseconds after the post. A read NIXL completes in 0.1-0.2 ms on one GPU
(the 90.6M hybrid's 10.7 MB, ``hybrid_pd/bench/nixl_floor.py``) is therefore always found
still in progress and noticed one step later; an idle decode engine sleeps 1 ms between
such steps (``vllm/v1/engine/core.py``, ``_process_engine_step``), and vLLM's transfer
time, which NIXL measures up to that later check, reads 1.56 ms against the floor's 0.17
(H100, vLLM 0.26, docs/performance.md).

With ``HYBRID_PD_PULL_AWAIT_US`` set, the decode worker waits, in the step that posted
them, up to that many microseconds for those reads to leave NIXL's in-progress state,
then lets vLLM check them as before. The wait is bounded and reads only NIXL's state:
a read still in progress then is noticed in a later step, as without the wait; a failed
one is handled by vLLM exactly as before.

Only a step that runs no model waits (:func:`awaits`): a step that runs one is a step every
running request waits for, and a wait in every step cost TPOT at real scale (docs/connector.md,
2026-11-25). An engine with nothing to run but the pulls it posted loses nothing by waiting, and
that is the engine of a request's hand-off at low load, where the step it saves shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

__all__ = ["await_transfers", "awaits", "posted_since"]

IN_PROGRESS = "PROC"  # NIXL's state of a transfer still moving (vLLM compares with the same string)


def awaits(budget_s: float, scheduled_tokens: int) -> bool:
    """Whether the model workers wait for the pulls a step posts: a budget, and a step that runs no model (schedules no token)."""
    return budget_s > 0 and scheduled_tokens == 0


def posted_since(before: Mapping[str, Sequence[int]], after: Mapping[str, Sequence[int]]) -> list[int]:
    """The transfer handles in ``after`` (vLLM's ``_recving_transfers``: request -> handles) that ``before`` did not hold."""
    seen = {handle for handles in before.values() for handle in handles}
    return [handle for handles in after.values() for handle in handles if handle not in seen]


def await_transfers(
    handles: Iterable[int], state_of: Callable[[int], str], budget_s: float, clock: Callable[[], float] = time.perf_counter
) -> bool:
    """Poll ``state_of`` until no handle is in progress or ``budget_s`` has passed; True when none is left in progress.

    ``state_of`` is NIXL's ``check_xfer_state``: asking it also drives the transfer on.
    A handle whose state cannot be read is left for vLLM's own check, which reports it.
    """
    pending = list(handles)
    deadline = clock() + budget_s
    while pending:
        still = []
        for handle in pending:
            try:
                if state_of(handle) == IN_PROGRESS:
                    still.append(handle)
            except Exception:  # noqa: BLE001 - vLLM's check right after this one logs and handles it
                continue
        pending = still
        if pending and clock() >= deadline:
            return False
    return True
