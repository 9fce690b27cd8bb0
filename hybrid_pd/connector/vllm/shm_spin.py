"""vLLM's processes wait for each other's next message with a core to spare (CPU): the spin sleeps instead of yielding.

vLLM's shared-memory message queues (``vllm/distributed/device_communicators/shm_broadcast.py``)
let a reader, a model worker waiting for the engine's next step or an engine waiting for its
worker's output, spin for ``busy_loop_s`` = 1 s after every read, calling ``sched_yield`` in a
loop, before it parks on the writer's ZeroMQ notification; a writer whose ring is full spins the
same way. On a GPU host each such process has a core of its own. On the 2-core CPU machine they do
not: vLLM 0.32 puts every P/D model worker on the last core (issue #36, docs/reliability.md), and a
yielding spinner keeps its fair share of that core, so under a steady stream of requests the
decode worker's spin starved the prefill worker's model beside it: starts that looked hung, a P/D
prefill forward of 250-470 ms for a prompt colocated answers in 39 ms (docs/performance.md), and in
the end-to-end suite whole stacks whose engines stopped answering.

Spinning less is not the way: parked readers miss some notifications, and vLLM bounds that by
re-checking every 5 s (its ``SHM_READER_RECHECK_INTERVAL_MS``): with a 1 ms spin the CPU stack's
inter-token latency p99 was 5.0 s. So the spin stays as long as vLLM makes it, but each turn sleeps
:data:`SPIN_SLEEP_S` instead of yielding: the core is free between looks, and a message is seen
within about that long, against the milliseconds a CPU engine step takes. Our plugin swaps the
function in that module where a worker asks for it (CPU) and where vLLM still spins with it.
"""

from __future__ import annotations

import time

__all__ = ["DOES", "SPIN_SLEEP_S", "apply", "probe"]

SPIN_SLEEP_S = 50e-6
DOES = f"each turn sleeps {SPIN_SLEEP_S * 1e6:g} us instead, leaving the core to the others"


def _sleep_a_little() -> None:
    time.sleep(SPIN_SLEEP_S)


def probe() -> str | None:
    """Why this vLLM needs the fix (its message queues spin with ``sched_yield``), or None when it has nothing to swap."""
    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "sched_yield", None)
    return "vLLM's message queues spin with sched_yield" if callable(spin) and spin is not _sleep_a_little else None


def apply() -> None:
    """vLLM's message queues sleep :data:`SPIN_SLEEP_S` where they yielded the core."""
    from vllm.distributed.device_communicators import shm_broadcast

    shm_broadcast.sched_yield = _sleep_a_little
