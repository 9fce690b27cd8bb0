"""``hybrid-pd profile`` without a server: its fit recovers a known profile from what that profile's server would measure, its
full-batch window, its plan within a server's limits, its usage errors (a real server: tests/e2e/test_profile_e2e.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hybrid_pd.bench.client import RequestResult
from hybrid_pd.cli import main
from hybrid_pd.sizing.fitting import fit_transfer
from hybrid_pd.sizing.layouts import Layout
from hybrid_pd.sizing.measure import DecodePoint, full_batch_step
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.profiler import FULL, QUICK, Measurements, Settings, attention_block_tokens, burst_workload, fit_profile
from hybrid_pd.sizing.simulate import SLO, predict
from hybrid_pd.sizing.workload import Lengths, Workload
from tests.sizing_support import tiny_profile

FITTED = Path(__file__).resolve().parent.parent / "hybrid_pd" / "bench" / "results" / "2026-11-25-h100x2-sizing" / "profile.json"
ONE = Layout("replicas", 0, 1)
ANY = SLO(float("inf"), float("inf"))

# The truth the synthetic server runs: a 4096-token budget, so the 5000-token prompt takes two steps.
TRUTH = tiny_profile(
    decode={"base_ms": 4.0, "per_seq_ms": 0.3, "per_context_token_ms": 0.002}, prefill_per_token_ms=0.02,
    prompt_latency_ms=[(100, 12.0), (1000, 25.0), (5000, 40.0)], transfer={"latency_ms": 2.5, "bandwidth_gbps": 3.0},
)  # fmt: skip
SETTINGS = Settings("tiny", "test", TRUTH.shape, TRUTH.block_tokens, TRUTH.cache_bytes, TRUTH.max_num_seqs, TRUTH.max_num_batched_tokens)
BASE = tiny_profile(handoff_ms=7.0, transfer={"latency_ms": 9.0, "bandwidth_gbps": 0.5})


def measured_by(truth: Profile, transfers: bool = True) -> Measurements:
    """What the server of ``truth`` would measure: its simulated lone TTFTs and burst, its step at each batch, its transfers."""
    lone = {}
    for n, _ in truth.prompt_latency_ms:
        lone[n] = [predict(truth, ONE, Workload(Lengths(n, n), Lengths(1, 1), 1, concurrency=1), ANY).ttft_p50_ms] * 2
    m = Measurements(lone, 800, 24, [], [], [])
    burst = predict(truth, ONE, burst_workload(m), ANY).throughput_rps
    decode = [DecodePoint(rows, ctx, truth.step_ms(rows, int(rows * ctx), 0), ctx, 16) for rows in (1, 8, 32) for ctx in (100, 2000)]
    xfers = [(b, truth.transfer.ms(b)) for b in (1e5, 1e6, 5e6)] if transfers else []
    return Measurements(lone, 800, 24, [burst, burst], decode, xfers)


def test_the_fit_recovers_the_profile_that_produced_the_measurements():
    got = fit_profile(measured_by(TRUTH), SETTINGS, BASE, "synthetic")
    assert got.decode.base_ms == pytest.approx(4.0) and got.decode.per_seq_ms == pytest.approx(0.3)
    assert got.decode.per_context_token_ms == pytest.approx(0.002)
    assert got.prefill_per_token_ms == pytest.approx(0.02, rel=1e-3)
    assert [n for n, _ in got.prompt_latency_ms] == [100, 1000, 5000]
    assert [ms for _, ms in got.prompt_latency_ms] == pytest.approx([12.0, 25.0, 40.0], abs=0.05)
    assert got.transfer.latency_ms == pytest.approx(2.5) and got.transfer.bandwidth_gbps == pytest.approx(3.0)
    assert got.handoff_ms == 7.0 and got.source == "synthetic"  # one server shows no hand-off: the base's


def test_without_transfers_the_base_profile_s_transfer_is_kept():
    got = fit_profile(measured_by(TRUTH, transfers=False), SETTINGS, BASE, "synthetic")
    assert got.transfer == BASE.transfer
    unfitted = dataclasses.replace(measured_by(TRUTH), transfer_error="ValueError: the measured transfer time does not grow")
    assert fit_profile(unfitted, SETTINGS, BASE, "synthetic").transfer == BASE.transfer  # measured, kept on record, not fitted
    assert got.prefill_per_token_ms == pytest.approx(0.02, rel=1e-3)


def test_a_slower_prefill_is_told_from_a_longer_prompt_latency():
    """Both lengthen the lone TTFT; only the prefill cost slows the burst, so each is fitted back to its own quantity."""
    slower = TRUTH.model_copy(update={"prefill_per_token_ms": 0.05})
    got = fit_profile(measured_by(slower), SETTINGS, BASE, "synthetic")
    assert got.prefill_per_token_ms == pytest.approx(0.05, rel=1e-3)
    assert [ms for _, ms in got.prompt_latency_ms] == pytest.approx([12.0, 25.0, 40.0], abs=0.05)


def _result(sent: float, ttft: float, gaps: list[float]) -> RequestResult:
    return RequestResult(sent_at=sent, e2e_s=ttft + sum(gaps), ttft_s=ttft, itl_s=tuple(gaps), output_tokens=len(gaps) + 1)


def test_only_the_tokens_while_every_request_decodes_count_and_a_burst_keeps_the_rate():
    """B's first token comes at 0.30 s and A's last at 0.49 s: the full batch runs in between, 190 ms in which A got 4 tokens
    and B 3: a step is 190 ms x 2 requests / 7 tokens. C's frontend fell behind and streamed 3 tokens at once at 0.48 s:
    its gaps are near 0, the tokens still count."""
    a = _result(0.0, 0.10, [0.05, 0.05, 0.09, 0.05, 0.05, 0.05, 0.05])  # tokens 0-7 at .10 .15 .20 .29 .34 .39 .44 .49
    b = _result(0.0, 0.30, [0.06, 0.06, 0.06, 0.06])  # tokens 0-4 at .30 .36 .42 .48 .54
    c = _result(0.0, 0.28, [0.03, 0.17, 0.00001, 0.00001, 0.1])  # tokens 0-5 at .28 .31 .48 .48001 .48002 .58
    assert full_batch_step([a, b]) == (pytest.approx((4 + 5 + 6 + 7 + 1 + 2 + 3) / 7), pytest.approx(190 * 2 / 7))
    assert full_batch_step([a, b, c]) == (pytest.approx((22 + 6 + 10) / 11), pytest.approx(190 * 3 / 11))
    late = _result(0.0, 0.485, [0.001, 0.001])  # its first token when A is almost done: 3 tokens inside, too few for 3 requests
    assert full_batch_step([a, b, late]) is None
def test_a_batch_that_did_not_decode_together_is_sent_again_with_new_prompts_and_longer_outputs_and_the_error_stands_after_every_try(monkeypatch):
    import asyncio

    from hybrid_pd.sizing import measure

    a = _result(0.0, 0.10, [0.05, 0.05, 0.09, 0.05, 0.05, 0.05, 0.05])
    b = _result(0.0, 0.30, [0.06, 0.06, 0.06, 0.06])
    late = _result(0.0, 0.485, [0.001, 0.001])
    sent: list[list[dict]] = []

    def batches(*answers):
        async def together(pool, url, bodies):
            sent.append(list(bodies))
            return answers[len(sent) - 1]

        return together

    server = measure.Server("http://127.0.0.1:9", "m", 500)
    monkeypatch.setattr(measure, "_together", batches([a, late], [a, b]))
    point = asyncio.run(measure.decode_point(None, server, 2, 8, [8, 16, 32], seed=1))
    assert point.step_ms == pytest.approx(190 * 2 / 7) and len(sent) == 2 and point.output_len == 16
    assert sent[0][0]["prompt"] != sent[1][0]["prompt"], "new prompts: none of the first try's in a prefix cache"
    assert [b["max_tokens"] for b in sent[1]] == [16, 16], "the second try decodes longer"
    sent.clear()
    monkeypatch.setattr(measure, "_together", batches(*[[a, late]] * 3))
    with pytest.raises(measure.MeasureError, match="3 times"):
        asyncio.run(measure.decode_point(None, server, 2, 8, [8, 16, 32], seed=1))
    assert [s[0]["max_tokens"] for s in sent] == [8, 16, 32]


def test_each_try_at_a_decode_point_doubles_the_output_within_the_model_length_and_the_cache():
    server = Profile.load(FITTED)  # Nemotron-H-8B, 8 GiB of KV cache
    plan = QUICK.shaped(server, max_model_len=512)
    first = plan.output_len_for(4, 32, server)
    assert plan.decode_tries(4, 32, server, 3) == [first, 2 * first, 4 * first]
    assert plan.decode_tries(4, 32, server, 4)[-1] == 4 * first, "8x would pass the model's 512 tokens: the last length that fits again"
    assert QUICK.shaped(server, max_model_len=32 + first + 1).decode_tries(4, 32, server, 3) == [first] * 3
    long_prompt = server.block_tokens - 2 * first - 1  # 2x the output ends in the first attention block, 4x in the second
    small = server.model_copy(update={"cache_bytes": 4 * server.memory_bytes(server.block_tokens) + server.memory_layout()[1]})  # 4 rows of one block, and the null block
    first = plan.output_len_for(4, long_prompt, small)
    assert QUICK.shaped(small, 8192).decode_tries(4, long_prompt, small, 3) == [first, 2 * first, 2 * first]


def test_the_plan_stays_within_the_server_s_sequences_cache_and_model_length():
    server = Profile.load(FITTED)  # Nemotron-H-8B, 8 GiB of KV cache: 72 sequences of ~350 tokens, 50 of ~3100
    plan = FULL.shaped(server, max_model_len=4096)
    assert max(plan.prompt_lens) == 4094 and plan.burst_prompt_len == 2048  # 4094 + 2 tokens through P/D: an H200 run asked 4095 + 2, HTTP 400
    for n, rows in plan.decode_batches(server):
        out = plan.output_len_for(rows, n, server)
        assert rows <= server.max_num_seqs and rows * server.memory_bytes(n + out) <= server.cache_bytes
        assert n + out < 4096 and out >= FULL.decode_output_len + rows * n / server.max_num_batched_tokens
    # 72 sequences of 256+99 tokens fit by bytes; vLLM keeps a block as its null block: 71 (on an H200, 72 never decoded together)
    assert (256, 71) in plan.decode_batches(server) and (256, 1) in plan.decode_batches(server)
    assert plan.burst_requests(server) == 32  # 8 budgets of 8192 tokens in 2048-token prompts


def test_the_attention_block_is_the_one_vllm_ran_nemotron_h_8b_with():
    assert attention_block_tokens(Profile.load(FITTED).shape) == 1040


def test_a_transfer_fit_needs_two_sizes_and_time_growing_with_bytes():
    with pytest.raises(ValueError, match="two sizes"):
        fit_transfer([(1e6, 2.0), (1e6, 2.1)])
    with pytest.raises(ValueError, match="does not grow"):
        fit_transfer([(1e6, 2.0), (2e6, 1.0)])


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--transfer-router", "http://127.0.0.1:9"], "--transfer-router and --transfer-metrics go together"),
        ([], "cannot list the models of http://127.0.0.1:9/v1/models"),
    ],
)
def test_usage_errors_name_the_flag_and_exit_2(tmp_path, capsys, extra, named):
    argv = ["profile", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "p.json"), "--max-num-seqs", "8", "--max-num-batched-tokens", "2048"]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid-pd profile: ") and named in err and not (tmp_path / "p.json").exists()
