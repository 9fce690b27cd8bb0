"""The cpu profile of docker-compose.yml, built and started through Compose v2 on Podman (``make test-compose``).

Session fixtures, in order: a clean engine with the images' inputs (``engine``), the images
built from ``deploy/*.Dockerfile`` (``built``), the services up and healthy (``stack``). Each
phase's time is logged; ``stack``'s teardown runs ``down -v`` whatever the tests did.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hybrid_pd.common.processes import free_port
from hybrid_pd.router.health import wait_routed
from tests.compose.sandbox_support import MODEL, Compose, Engine, Rlimits, make_inputs, nixl_reads, timed
from tests.e2e.support import until_pulled

log = logging.getLogger("compose-ci")


@pytest.fixture(scope="session")
def times() -> Iterator[dict[str, float]]:
    """Seconds per phase of the run, logged at the end."""
    phases: dict[str, float] = {}
    yield phases
    log.info("phases (s): %s", phases)


@pytest.fixture(scope="session")
def engine(times: dict[str, float]) -> Iterator[Engine]:
    directory = Path(tempfile.mkdtemp(prefix="hybrid-pd-compose-"))
    engine: Engine | None = None
    try:
        with timed("inputs", times):
            inputs = make_inputs(directory, times)
        engine = Engine(directory, inputs, Rlimits.of_this_host())
        with timed("engine start and base image import", times):
            engine.start()
        yield engine
    finally:
        if engine is not None:
            engine.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def compose(engine: Engine) -> Compose:
    return Compose(engine, {"ROUTER_PORT": str(free_port())})


@pytest.fixture(scope="session")
def built(compose: Compose, times: dict[str, float]) -> Compose:
    with timed("compose build (worker and router images)", times):
        compose("build")
    return compose


@pytest.fixture(scope="session")
def stack(built: Compose, times: dict[str, float]) -> Iterator[Compose]:
    try:
        with timed("compose up until every service is healthy", times):
            built.up()
        yield built
    finally:
        with timed("compose down -v", times):
            built("down", "--volumes", "--timeout=30")


@pytest.fixture(scope="session")
def router(stack: Compose) -> Iterator[httpx.Client]:
    """The router's published port, once the router routes to both workers.

    Healthy means a decode worker is available; until the router's own health check has
    passed the prefill worker too, a request is prefilled where it is decoded, and no state
    crosses NIXL (hybrid_pd/router/health.py).
    """
    url = f"http://127.0.0.1:{stack.env['ROUTER_PORT']}"
    with httpx.Client(base_url=url, timeout=120) as client:
        workers = {"http://prefill-cpu:8100", "http://decode-cpu:8200"}  # docker-compose.yml's router-cpu
        assert wait_routed(url, workers, 60), f"the router does not route to both workers: {client.get('/health').json()}"
        # The decode worker's first NIXL handshake, before the tests count transfers: why in
        # tests/e2e/support.py's make_handshakes (the workers' ports are not published here). CI's
        # host once ran out vLLM's 5 s reply wait twice in a row (stop 43), so it is tried until one pulls.
        def warm_up() -> None:
            warm = client.post("/v1/completions", json={"model": MODEL, "prompt": "warm up the handshake", "max_tokens": 4})
            assert warm.status_code == 200, warm.text

        until_pulled(warm_up, lambda: nixl_reads(stack))
        yield client
