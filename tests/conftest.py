"""Shared fixtures: scripted workers and a router in front of them (router tests), ``dry_run`` (deployment tests)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybrid_pd import default_model
from hybrid_pd.cli import main
from tests.deploy_support import container_environment
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


@pytest.fixture
def dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Run ``hybrid-pd ... --dry-run`` in-process with a container's environment; return its JSON.

    The embedded default model resolves to its usual path under a temporary
    ``HYBRID_PD_HOME`` without being built: these tests are about command lines.
    """
    monkeypatch.setattr(default_model, "ensure_default_model", default_model.default_model_dir)
    monkeypatch.setenv("HYBRID_PD_HOME", str(tmp_path / "home"))

    def run(argv: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
        with container_environment(env or {}):
            capsys.readouterr()
            assert main([*argv, "--dry-run"]) == 0
            return json.loads(capsys.readouterr().out)

    return run
