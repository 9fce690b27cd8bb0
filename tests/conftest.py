"""Fixtures shared by the router's tests: scripted workers and a router in front of them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.router_support import Workers, asgi_client, router_app


@pytest.fixture
def workers() -> Workers:
    return Workers()


@pytest.fixture
async def client(workers: Workers) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a router (running: its lifespan entered) in front of ``workers``."""
    app = router_app(workers)
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as c:
            yield c
