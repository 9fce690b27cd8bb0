"""What the router's ``GET /health`` says, written and read in one place.

The router answers 200 once a decode worker can take requests: prefill workers are optional
(a request without one is prefilled where it is decoded). A caller that wants every request
disaggregated from the first one on (``hybrid-pd up``, the benchmarks, the compose test)
waits until the body lists each of its workers as available too: a router that has not yet
seen a worker pass a health check routes around it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import httpx

from hybrid_pd.router.registry import ROLES, Registry

__all__ = ["available_urls", "health_body", "listed_urls", "wait_routed"]


def health_body(registry: Registry, ready: bool) -> dict[str, Any]:
    """The body: a status, every worker's URL by role, and those available by role."""
    return {
        "status": "ok" if ready else "no decode worker available",
        **{role: [w.url for w in registry.role(role)] for role in ROLES},
        "available": {role: [w.url for w in registry.role(role) if w.available] for role in ROLES},
    }


def listed_urls(body: dict[str, Any]) -> set[str]:
    """Every worker the router knows, whatever its state."""
    return {url for role in ROLES for url in body.get(role, [])}


def available_urls(body: dict[str, Any]) -> set[str]:
    """The workers the router routes to now."""
    return {url for role in ROLES for url in body.get("available", {}).get(role, [])}


def wait_routed(router: str, workers: set[str], timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Poll ``router``'s /health until it lists every one of ``workers`` (URLs) as available; False after ``timeout_s`` or once not ``alive()``."""
    deadline = time.monotonic() + timeout_s
    while alive() and time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if workers <= available_urls(httpx.get(router + "/health", timeout=5).json()):
                return True
        time.sleep(0.5)
    return False
