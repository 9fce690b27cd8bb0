"""Keep a CPU model worker's compute thread on the cores its server was given.

vLLM 0.32's NIXL connector worker (``NixlBaseConnectorWorker.__init__`` in
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``), on CPU, moves the thread that
builds it to the last core of each NUMA node (``os.sched_setaffinity(0, ...)``, meant to "reserve
different cores for start_load_kv() from model_forward()"). That thread is the model worker's main
thread, OpenMP's master thread, which runs the model: with one core bound, the only one. So every P/D
model worker on a host ran on that one core, whatever ``VLLM_CPU_OMP_THREADS_BIND`` said: on the
2-core machine the prefill's (bound to 0) and the decode's (bound to 1) both ran on core 1, a busy
decode worker starved a starting prefill worker into what looked like a hang (issue #36,
docs/reliability.md). A colocated server loads no connector and kept its binding.

:func:`kept_affinity` puts the thread back where it was (where OpenMP's binding had put it) once vLLM's
connector is built. Threads vLLM's connector starts meanwhile keep the core vLLM chose for them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["kept_affinity"]

log = logging.getLogger("vllm.hybrid_pd.cpu_affinity")  # under vLLM's logger: printed with its lines


def _cores(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


@contextmanager
def kept_affinity(what: str) -> Iterator[None]:
    """The calling thread's CPU affinity as it was before the block, whatever the block set (``what``: who moved it, logged)."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux: nothing to keep
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        moved_to = os.sched_getaffinity(0)
        if moved_to != before:
            os.sched_setaffinity(0, before)
            log.info("%s moved the model's thread to cores %s; put it back on cores %s", what, _cores(moved_to), _cores(before))
