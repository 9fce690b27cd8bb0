"""What every request of one router app shares, in a module of its own so any part may import it."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_pd.router.metrics import RouterMetrics
from hybrid_pd.router.pairing import Pairing
from hybrid_pd.router.planner import Planner
from hybrid_pd.router.registry import Registry
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.router.upstream import Upstream

__all__ = ["RouterState"]


@dataclass
class RouterState:
    """Everything a request needs, built once per app; ``upstream`` is set while the app runs."""

    settings: RouterSettings
    registry: Registry
    metrics: RouterMetrics
    pairing: Pairing
    planner: Planner
    upstream: Upstream | None = None
    inflight: int = 0
