"""The arithmetic of hybrid_pd/bench/gpu/goodput.py: goodput per SLO pair from vLLM's per-request results, and its table.

The GPU run itself needs two NVIDIA GPUs; tests/e2e/test_flex.py runs the runner on CPU.
"""

from __future__ import annotations

import pytest

from hybrid_pd.bench.gpu.goodput import SYSTEMS, Workload, _server_flags, parse_args, summarize, table
from hybrid_pd.sizing.layouts import RUNNER_SYSTEMS


def _result(ttfts, latencies, output_lens, errors=None, duration=2.0):
    n = len(ttfts)
    return {"ttfts": ttfts, "latencies": latencies, "output_lens": output_lens, "itls": [[0.01] * (o - 1) for o in output_lens],
            "errors": errors or [""] * n, "duration": duration, "request_goodput": None}  # fmt: skip


def test_goodput_counts_requests_within_both_targets_per_pair_and_per_gpu():
    # TTFT 0.1 s, TPOT (1.1 - 0.1) / 100 = 10 ms; TTFT 0.6 s, TPOT 10 ms; TTFT 0.1 s, TPOT 30 ms; a failed one.
    result = _result([0.1, 0.6, 0.1, 0.05], [1.1, 1.6, 3.1, 0.1], [101, 101, 101, 0], errors=["", "", "", "boom"])
    s = summarize(result, [(500, 20), (1500, 50)], gpus=2)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["goodput"]["500/20"] == {"req_s": 0.5, "per_gpu": 0.25}  # only the first: 1 request in 2 s
    assert s["goodput"]["1500/50"] == {"req_s": 1.5, "per_gpu": 0.75}
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 151.5
    assert s["tpot_ms"]["mean"] == pytest.approx((10 + 10 + 30) / 3)
    assert s["ttft_ms"]["p50"] == pytest.approx(100)


def test_a_one_token_answer_has_no_tpot_to_break():
    s = summarize(_result([0.2], [0.2], [1]), [(500, 20)], gpus=1)
    assert s["goodput"]["500/20"]["req_s"] == 0.5 and s["tpot_ms"]["mean"] == 0


def test_the_table_sets_every_system_against_the_replicas_at_the_same_point():
    fast = summarize(_result([0.1] * 4, [1.1] * 4, [101] * 4), [(500, 20)], gpus=2)
    slow = summarize(_result([0.1, 0.1, 0.9, 0.9], [1.1, 1.1, 1.9, 1.9], [101] * 4), [(500, 20)], gpus=2)
    rows = [{"system": "replicas", "workload": "1000/64", "level": 32, "summary": slow},
            {"system": "adaptive", "workload": "1000/64", "level": 32, "summary": fast}]  # fmt: skip
    text = table(rows, ["500/20"])
    assert "| 1000/64 | 32 | adaptive | 2.00 | 1.00 | 10.0 | 10.0 | 100.0 | 100.0 | 2.00x | 1.00x |" in text
    assert "| 1000/64 | 32 | replicas | 2.00 | 0.50 |" in text


def test_every_system_but_the_baseline_runs_hybrid_pd_on_the_flex_workers():
    urls = {name: f"http://{name}" for name in ("colocated0", "colocated1", "flex0", "flex1")}
    argv = {name: system.router_argv(urls, (500, 20), 9000) for name, system in SYSTEMS.items()}
    assert argv["replicas"][-4:] == ["--decode", "http://colocated0", "--decode", "http://colocated1"]
    assert argv["pd"][-4:] == ["--prefill", "http://flex0", "--decode", "http://flex1"]
    assert argv["adaptive"][-8:] == ["--flex", "http://flex0", "--flex", "http://flex1", "--slo-ttft-ms", "500", "--slo-tpot-ms", "20"]
    assert str(Workload.parse("3000/128")) == "3000/128"


def test_the_detached_server_process_gets_the_runs_systems_and_extra_flags(tmp_path):
    """``run`` starts ``serve`` in another process from these flags: it started every system's servers before (--systems was not passed on)."""
    args = parse_args(["run", "--out", str(tmp_path), "--model", str(tmp_path), "--systems", "pd", "--server-arg=--vllm-arg=--enable-prefix-caching",
                       "--router-arg=--decode-policy=prefix_reuse", "--slo", "400/30"])  # fmt: skip
    again = parse_args(["serve", *_server_flags(args)])
    assert again.systems == ["pd"] and again.slo == [(400.0, 30.0)]
    assert again.server_arg == ["--vllm-arg=--enable-prefix-caching"] and again.router_arg == ["--decode-policy=prefix_reuse"]


def test_the_simulator_lays_out_each_runner_system_on_as_many_gpus():
    """The sizing checks read the runner's rows by system name (hybrid_pd.sizing.layouts.RUNNER_SYSTEMS)."""
    assert set(RUNNER_SYSTEMS) == set(SYSTEMS)
    assert {name: layout.gpus for name, layout in RUNNER_SYSTEMS.items()} == {name: len(s.legs) for name, s in SYSTEMS.items()}
