"""What a P/D worker's engine sees of each request, for the hand-off timeline (:mod:`hybrid_pd.connector.trace.timeline`).

Our connector (:mod:`hybrid_pd.connector.vllm.nixl_connector`) calls these from vLLM's connector hooks;
the timestamps are vLLM's own where vLLM keeps them, ours at the hook otherwise:

| event | when | clock |
|---|---|---|
| ``engine_in`` | vLLM's frontend took the request (after the HTTP body and the prompt's rendering) | vLLM's ``Request.arrival_time`` (the frontend's wall clock) |
| ``queued`` | the engine core queued it | vLLM's ``QUEUED`` engine event, else first seen by the scheduler |
| ``scheduled`` | a scheduler step took it: the prefill's forward; on the decode worker, the step that recomputes token N after the pull (the decode row) | vLLM's ``SCHEDULED`` engine event (the step's start), else when that step's connector metadata is built |
| ``done`` | prefill: the request finished (prompt run, its one token sampled, state held for the pull) | ``request_finished`` |
| ``handoff_taken`` | decode, an early leg held in vLLM's scheduler: its push came to the engine's inbox | when the scheduler read it (:mod:`hybrid_pd.connector.vllm.scheduler_hold`) |
| ``pull_queued`` | decode: blocks allocated for the pull, which the next step's metadata hands to the model worker | ``update_state_after_alloc`` |
| ``pull_posted`` | decode: the NIXL read is posted (after any handshake with the prefill) | after the model worker's ``start_load_kv`` |
| ``pull_done`` / ``pull_failed`` | decode: the model worker noticed the read complete (or failed: the prompt is recomputed) | in ``get_transfer_results`` / ``get_finished``, once per engine step |

Only requests whose ``kv_transfer_params`` carry the router's id (:data:`REQUEST_ID_PARAM`)
are traced. Scheduler-side events carry both ids; model-worker events only vLLM's (a
TP group's every rank writes its own; the join takes the first post and the last completion).
vLLM's engine events exist only while vLLM collects stats (its default); their absence is
a capability, checked on the objects, never on a version.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

from hybrid_pd.connector.trace.timeline import REQUEST_ID_PARAM, TimelineWriter

__all__ = ["EngineTimeline", "vllm_event_time"]


def vllm_event_time(request: Any, kind: str) -> float | None:
    """The latest of vLLM's engine events of type ``kind`` (``QUEUED``, ``SCHEDULED``) still on ``request``: its monotonic time."""
    found = None
    for event in getattr(request, "events", None) or ():
        if getattr(getattr(event, "type", None), "name", None) == kind:
            found = getattr(event, "timestamp", None)
    return found


class EngineTimeline:
    """Timeline events of one engine process: the scheduler side (``prefill`` marks ``done``) and the model-worker side."""

    def __init__(self, writer: TimelineWriter, prefill: bool) -> None:
        self._writer = writer
        self._prefill = prefill
        self._waiting: dict[str, tuple[Any, str]] = {}  # scheduler: vLLM id -> (request, router id), until scheduled
        self._traced: dict[str, str] = {}  # scheduler: vLLM id -> router id, until finished
        self._posted: set[str] = set()  # model worker: pulls in flight already recorded

    # Scheduler side.
    def seen(self, request: Any) -> None:
        """The scheduler looks at ``request`` (every time it is waiting); the first look records ``engine_in`` and ``queued``."""
        req = request.request_id
        if req in self._traced:
            return
        rid = (request.kv_transfer_params or {}).get(REQUEST_ID_PARAM)
        if not isinstance(rid, str):
            return
        self._traced[req] = rid
        self._waiting[req] = (request, rid)
        arrival = getattr(request, "arrival_time", None)
        if isinstance(arrival, (int, float)):
            self._writer.event("engine_in", rid=rid, req=req, wall=float(arrival))
        queued = vllm_event_time(request, "QUEUED")
        self._writer.event("queued", rid=rid, req=req, **({"mono": queued} if queued is not None else {}))

    def handoff_taken(self, request: Any, pushed_at: float) -> None:
        """Decode, an early leg held in the scheduler: its push, which came at ``pushed_at`` (monotonic), was taken."""
        rid = self._traced.get(request.request_id)
        if rid is not None:
            self._writer.event("handoff_taken", rid=rid, req=request.request_id, mono=pushed_at)

    def pull_queued(self, request: Any) -> None:
        """Decode: blocks were allocated for ``request``'s pull."""
        rid = self._traced.get(request.request_id)
        if rid is not None:
            self._writer.event("pull_queued", rid=rid, req=request.request_id)

    def step(self, scheduled: Container[str]) -> None:
        """A scheduler step took the requests ``scheduled`` (vLLM ids); the first step of each traced one records ``scheduled``."""
        for req in [r for r in self._waiting if r in scheduled]:
            request, rid = self._waiting.pop(req)
            at = vllm_event_time(request, "SCHEDULED")
            self._writer.event("scheduled", rid=rid, req=req, **({"mono": at} if at is not None else {}))

    def finished(self, request: Any) -> None:
        """``request`` finished (or was aborted); on a prefill worker, a traced one records ``done``."""
        req = request.request_id
        self._waiting.pop(req, None)
        rid = self._traced.pop(req, None)
        if rid is not None and self._prefill:
            self._writer.event("done", rid=rid, req=req)

    # Model-worker side.
    def posted(self, in_flight: Iterable[str]) -> None:
        """The pulls now in flight (vLLM ids); those not seen before were posted in this step."""
        for req in in_flight:
            if req not in self._posted:
                self._posted.add(req)
                self._writer.event("pull_posted", req=req)

    def pulled(self, done: Iterable[str], failed: Iterable[str] = ()) -> None:
        """The model worker noticed these pulls complete, ``failed`` among them; each is recorded once."""
        failed = set(failed)
        for req in set(done) | failed:
            if req in failed:
                self._posted.discard(req)
                self._writer.event("pull_failed", req=req)
            elif req in self._posted:
                self._posted.discard(req)
                self._writer.event("pull_done", req=req)
