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

:func:`kept_affinity` keeps the thread where it was (where OpenMP's binding had put it) while vLLM's
connector is built: vLLM's call to move it is not carried out (logged), and whatever moved it otherwise
is undone at the end. Putting it back only at the end was not enough: the rest of the constructor
(NIXL's set-up, a second in a healthy start) ran on the last core, and a start stuck there, starved by the decode worker that
spins on that core, in 1 of 20 starts (docs/reliability.md). Threads the constructor starts get the
thread's own cores.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["kept_affinity"]

log = logging.getLogger("vllm.hybrid_pd.cpu_affinity")  # under vLLM's logger: printed with its lines


def _cores(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


@contextmanager
def kept_affinity(what: str) -> Iterator[None]:
    """The calling thread stays on the cores it has: ``os.sched_setaffinity`` of it inside the block is not carried
    out, and a move made otherwise is undone after the block (``what``: who asked, logged). Other threads' calls pass."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux: nothing to keep
        yield
        return
    before = os.sched_getaffinity(0)
    me = threading.get_native_id()
    real = os.sched_setaffinity
    asked: list[set[int]] = []

    def held(pid: int, cpus: Iterable[int]) -> None:
        if pid in (0, me) and threading.get_native_id() == me:
            asked.append(set(cpus))
            return
        real(pid, cpus)

    os.sched_setaffinity = held
    try:
        yield
    finally:
        os.sched_setaffinity = real
        if asked:
            log.info("%s asked to move the model's thread to cores %s; kept it on cores %s", what, _cores(asked[-1]), _cores(before))
        moved_to = os.sched_getaffinity(0)
        if moved_to != before:
            real(0, before)
            log.info("%s moved the model's thread to cores %s; put it back on cores %s", what, _cores(moved_to), _cores(before))
