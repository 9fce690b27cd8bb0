"""A decode worker that pulls after the prefill's KV lease ran out never answers from reused blocks.

The stack's prefill worker holds state for 3 s and has a small KV cache (64 blocks), so
freed blocks are soon handed to other requests. The decode leg is sent by hand, after
the lease ran out and the blocks were reused: what a decode worker stalled past the lease
(SIGSTOP, a long pause) does. Without our lease check (hybrid_pd/connector/vllm/kv_lease.py) vLLM reads
the reused blocks and answers another text with HTTP 200 (measured: ' Maya has 41 + 37 =
...' became '  35 =7\\n2 =>>  gets 21 / 6 = ...'); with it the pull counts as failed and
the prompt is recomputed locally: the colocated answer.
"""

from __future__ import annotations

import time

import httpx
import pytest

from hybrid_pd.common.processes import free_port
from hybrid_pd.connector.vllm.kv_lease import LEASE_EXPIRES_KEY
from hybrid_pd.default_model import resolve_model
from hybrid_pd.router.legs import decode_body, prefill_body
from hybrid_pd.stack import Stack, StackConfig
from tests.e2e.support import make_handshakes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

LEASE_S = 3
CACHE_BYTES = 8 * 1024 * 1024  # 64 blocks of the embedded model: a few dozen requests cycle through them all
QUESTION = "Question: Maya has 41 beads. She buys 37 more beads. How many beads does Maya have now?\nAnswer:"


@pytest.fixture(scope="module")
def short_lease_stack(tmp_path_factory):
    model, name = resolve_model(None, "hybrid-pd-tiny")
    config = StackConfig(
        model=model, served_model_name=name, port=free_port(), ready_timeout_s=600,
        log_dir=tmp_path_factory.mktemp("lease-logs"),
        worker_args=("--kv-lease-s", str(LEASE_S), "--kv-cache-memory-bytes", str(CACHE_BYTES)),
    )  # fmt: skip
    with Stack(config) as stack:
        make_handshakes(stack)
        yield stack


def test_a_pull_after_the_lease_ran_out_is_recomputed_not_answered_from_reused_blocks(short_lease_stack, colocated: httpx.Client):
    stack = short_lease_stack
    body = {"model": "hybrid-pd-tiny", "prompt": QUESTION, "max_tokens": 24, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        prefill, decode = (stack.workers(role)[0].url for role in ("prefill", "decode"))
        params = client.post(prefill + "/v1/completions", json=prefill_body(body)).json()["kv_transfer_params"]
        assert params[LEASE_EXPIRES_KEY] <= time.time() + LEASE_S
        time.sleep(LEASE_S + 1)
        # Each finished request frees its blocks to the back of vLLM's free queue: these walk the
        # whole cache, so the released state is overwritten (and the prefill's next step frees it).
        for i in range(40):
            filler = {"model": "hybrid-pd-tiny", "prompt": f"Question: Tom has {i} apples and {i + 3} pears " * 20, "max_tokens": 1}
            assert client.post(prefill + "/v1/completions", json=filler).status_code == 200
        answer = client.post(decode + "/v1/completions", json=decode_body(body, params))
        expected = colocated.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["text"] == expected
    assert "after the prefill's KV lease ran out" in stack.log_path("decode-0").read_text()


def test_requests_through_the_router_still_move_state_within_the_lease(short_lease_stack, colocated: httpx.Client):
    """The check costs nothing on the normal path: pulls inside the lease are used, not recomputed."""
    stack = short_lease_stack
    log_before = stack.log_path("decode-0").read_text().count("after the prefill's KV lease ran out")
    with httpx.Client(timeout=120) as client:
        for prompt in (QUESTION, "Once upon a time"):
            body = {"model": "hybrid-pd-tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            routed = client.post(stack.url + "/v1/completions", json=body).json()["choices"][0]["text"]
            assert routed == colocated.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert stack.log_path("decode-0").read_text().count("after the prefill's KV lease ran out") == log_before
