"""The prefill's KV lease, carried to the decode worker so that a pull of released state is never used.

A prefill worker holds a request's state (attention KV, conv and SSM state) for
``kv_lease_duration`` seconds after answering, then frees those blocks and reuses
them for later requests. vLLM's decode worker extends the lease with heartbeats
while it is alive, but a decode worker that stalls (SIGSTOP, a long GC or swap
pause, a request stuck in a socket buffer while its engine is busy) reads the
blocks after they were freed: NIXL reads registered memory one-sidedly, so the
read succeeds and returns another request's state. vLLM then generates from it
and the client gets fluent, wrong text with HTTP 200 (measured: 1 of 48 greedy
requests with one of two decode workers frozen 45 s; vLLM 0.32 has no check).

The fix, as data carried with the request:

- the prefill stamps the wall-clock time its lease runs out
  (:data:`LEASE_EXPIRES_KEY`) into the ``kv_transfer_params`` it answers with,
  taken *before* vLLM starts the lease, so the stamp is never later than the
  real expiry;
- the decode worker, when it notices a pull has completed, treats the pull as
  failed if the lease could have run out by then (:func:`pull_outlived_lease`);
  vLLM's ``kv_load_failure_policy=recompute`` then prefills the prompt locally,
  so the answer is the colocated one, only later.

Heartbeats are not counted: a pull that completes after the first lease ran out
is recomputed even if heartbeats kept the state alive. That costs a local
prefill only when a request waited longer than the lease before its pull
completed, and never a wrong answer. Wall clocks of the prefill and decode
hosts must agree within :data:`CLOCK_MARGIN_S` (NTP keeps them within
milliseconds); on one host they are the same clock.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CLOCK_MARGIN_S", "LEASE_EXPIRES_KEY", "lease_expiry", "pull_outlived_lease", "stamp_lease"]

# The field of ``kv_transfer_params`` that carries the lease's end (seconds since the epoch).
# vLLM ignores fields it does not know; the router passes the parameters on unchanged.
LEASE_EXPIRES_KEY = "hybrid_pd_lease_expires_at"

# How much earlier than the stamped expiry a pull already counts as too late: covers the
# difference between the prefill's and the decode's wall clocks.
CLOCK_MARGIN_S = 1.0


def stamp_lease(params: dict[str, Any] | None, lease_s: float, started_at: float) -> dict[str, Any] | None:
    """``params`` (a prefill's answer) with the lease's end, when they hand state to a remote decode.

    ``started_at`` is the wall-clock time read before vLLM started the lease.
    """
    if not params or not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
        return params
    return {**params, LEASE_EXPIRES_KEY: started_at + lease_s}


def lease_expiry(params: dict[str, Any] | None) -> float | None:
    """The stamped end of the lease in a decode request's ``kv_transfer_params`` (None: not stamped)."""
    if not params:
        return None
    value = params.get(LEASE_EXPIRES_KEY)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def pull_outlived_lease(expires_at: float | None, completed_at: float, margin_s: float = CLOCK_MARGIN_S) -> bool:
    """Whether a pull noticed complete at ``completed_at`` may have read state the prefill had freed.

    Unstamped pulls (a prefill worker without our connector) cannot be judged and pass.
    """
    return expires_at is not None and completed_at >= expires_at - margin_s
