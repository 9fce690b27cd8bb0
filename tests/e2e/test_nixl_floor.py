"""The NIXL trace records exactly what vLLM transferred, and the floor benchmark replays it.

The session stack's workers run with ``--nixl-trace-dir`` (tests/e2e/conftest.py).
"""

from __future__ import annotations

import pytest

from hybrid_pd.bench.nixl_floor import VARIANTS, Replay, measure_floor
from hybrid_pd.connector.vllm.nixl_trace import load_trace
from tests.e2e.support import metric, settled, traced, wait_for

pytestmark = pytest.mark.e2e  # it uses the session stack: `make test-unit` must not start vLLM


def test_trace_holds_every_descriptor_vllm_posted_and_replays(prefill_worker, decode_worker, stack, nixl_trace_dir):
    names = ("vllm:nixl_bytes_transferred_count", "vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_descriptors_sum")
    before = [metric(decode_worker, n) for n in names]
    traced_before = traced(nixl_trace_dir)
    for tokens in (40, 300):
        body = {"model": stack.config.served_model_name, "prompt": [7 + (i * 13) % 200 for i in range(tokens)], "max_tokens": 1}
        prefill = prefill_worker.post("/v1/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}}).json()
        answer = decode_worker.post("/v1/completions", json={**body, "kv_transfer_params": prefill["kv_transfer_params"]})
        assert answer.status_code == 200, answer.text
    assert wait_for(lambda: metric(decode_worker, names[0]) >= before[0] + 2, timeout_s=15)
    settled(lambda: metric(decode_worker, names[0]))
    transfers, moved, merged = (metric(decode_worker, n) - b for n, b in zip(names, before, strict=True))
    seen = [after - b for after, b in zip(traced(nixl_trace_dir), traced_before, strict=True)]
    assert transfers == seen[0] == 2
    assert moved == seen[2], "the trace's descriptors add up to the bytes vLLM reports"
    assert seen[1] > merged > 0, "our merge (hybrid_pd/connector/vllm/nixl_merge.py) posts fewer descriptors than vLLM built"

    trace = load_trace(nixl_trace_dir)
    assert trace.mem_type == "DRAM" and trace.op == "READ"
    results = measure_floor(trace, Replay(in_flight=(1, 2), repeats=3))
    assert [(r.variant, r.in_flight) for r in results] == [(v, k) for v in VARIANTS for k in (1, 2)]
    for r in results:
        assert r.transfers == 3 * r.in_flight
        assert r.wall_us_p50 > 0 and r.nixl_xfer_us_p50 >= 0
    posted = {r.variant: r for r in results if r.in_flight == 1}
    assert posted["one-descriptor"].descriptors_per_transfer == 1
    assert posted["one-descriptor"].bytes_per_transfer == posted["as-posted"].bytes_per_transfer
    assert posted["as-posted"].descriptors_per_transfer > posted["coalesced"].descriptors_per_transfer >= 1, (
        "a Mamba layer's x, B, C and SSM reads are adjacent on both sides"
    )
    assert posted["coalesced"].bytes_per_transfer == posted["as-posted"].bytes_per_transfer
