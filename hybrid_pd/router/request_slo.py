"""The SLO pair a request asks for: llm-d's ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` headers, else the router's targets.

The planner sizes the flexible workers for the pair most of the live traffic asked for
(:func:`hybrid_pd.sizing.planner.traffic_of`): a service whose chat wants its first token in
500 ms and whose documents may wait 4 s says so per request, and each phase of its traffic is
sized for its own. A header that is not a number of milliseconds above 0 is the client's error
(400), not a target silently dropped.
"""

from __future__ import annotations

import math

from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.sizing.workload import SLO

__all__ = ["TPOT_HEADER", "TTFT_HEADER", "request_slo", "router_slo"]

TTFT_HEADER, TPOT_HEADER = b"x-slo-ttft-ms", b"x-slo-tpot-ms"


def router_slo(settings: RouterSettings) -> SLO:
    """The router's own targets (``--slo-ttft-ms``, ``--slo-tpot-ms``), unbounded where unset."""
    return SLO(settings.slo_ttft_ms or math.inf, settings.slo_tpot_ms or math.inf)


def request_slo(ttft: bytes | None, tpot: bytes | None, default: SLO) -> SLO:
    """The pair a request's headers ask for (either may be left out: the router's ``default`` then)."""
    return SLO(_target(TTFT_HEADER, ttft, default.ttft_ms), _target(TPOT_HEADER, tpot, default.tpot_ms))


def _target(name: bytes, value: bytes | None, default: float) -> float:
    if value is None:
        return default
    try:
        ms = float(value.decode("latin-1"))
    except ValueError:
        ms = math.nan
    if not (0 < ms < math.inf):
        raise OpenAIError(400, f"header {name.decode()}: {value.decode('latin-1')!r} is not a number of milliseconds above 0")
    return ms
