"""What routers share with their peers for the planner (``GET /planner/peer``), as JSON: written here and read back.

One router's window of the traffic (:class:`~hybrid_pd.sizing.traffic.WindowView`: each arrival's
age, lengths and the SLO pair it asked for; the requests in flight over time) and the prompt
lengths its split serves. JSON has no infinity, so a target that is not set travels as null. A
peer's word is read defensively: what this router cannot read (a peer of another version) is left
out, not the whole look (:func:`window_of`, :func:`bounds_of`).
"""

from __future__ import annotations

import math
from typing import Any

from hybrid_pd.sizing.traffic import WindowView
from hybrid_pd.sizing.workload import SLO, Lengths

__all__ = ["bounds_json", "bounds_of", "window_json", "window_of"]


def window_json(view: WindowView) -> dict[str, Any]:
    """A router's window as it shares it: arrivals as [seconds ago, prompt, output, TTFT target, TPOT target]."""
    return {"arrived": [[round(a, 3), p, o, *_targets(slo)] for a, p, o, slo in view.arrived],
            "inflight": [[round(a, 3), n] for a, n in view.inflight]}  # fmt: skip


def bounds_json(bounds: Lengths | None) -> list[int] | None:
    """The prompt lengths a split serves as ``GET /planner`` and the peers show them: [low, high], or null for any."""
    return None if bounds is None else [bounds.low, bounds.high]


def bounds_of(shown: Any) -> Lengths | None:
    """:func:`bounds_json` of a peer read back; None (every prompt split as the roles say) for anything else."""
    if isinstance(shown, list) and len(shown) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in shown) and shown[0] <= shown[1]:
        return Lengths(shown[0], shown[1])
    return None


def _targets(slo: SLO | None) -> list[float | None]:
    """A request's SLO pair as JSON carries it: null for no target (JSON has no infinity) or no pair asked."""
    return [None, None] if slo is None else [None if math.isinf(t) else t for t in (slo.ttft_ms, slo.tpot_ms)]


def _slo(ttft: float | None, tpot: float | None) -> SLO | None:
    """:func:`_targets` read back."""
    return None if ttft is None and tpot is None else SLO(math.inf if ttft is None else float(ttft), math.inf if tpot is None else float(tpot))


def _arrival(age: Any, prompt: Any, output: Any, *targets: Any) -> tuple[float, int, int, SLO | None]:
    """One arrival of a peer's window: its age, lengths and, since peers share it, the SLO pair it asked for."""
    if len(targets) not in (0, 2):
        raise ValueError(f"an arrival of {3 + len(targets)} fields")
    return float(age), int(prompt), int(output), _slo(*targets) if targets else None


def window_of(window: Any) -> WindowView | None:
    """A peer's window from its JSON (:func:`window_json`); None for one this router cannot read (a peer of another version:
    the others' traffic is still sized for). Arrivals without their SLO pair (a peer from before it was shared) asked none."""
    try:
        arrived = tuple(_arrival(*entry) for entry in window["arrived"])
        return WindowView(arrived, tuple((float(a), int(n)) for a, n in window["inflight"]))
    except (TypeError, ValueError, KeyError):
        return None
