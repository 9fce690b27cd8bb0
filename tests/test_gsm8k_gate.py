"""The logic of hybrid_pd/bench/gpu/gsm8k_gate.py that decides PASS/FAIL (the GPU run itself needs an NVIDIA GPU)."""

from hybrid_pd.bench.gpu import gsm8k_gate as gate


def _rerun(tokens, tops):
    return {"logprobs": {"tokens": tokens, "top_logprobs": tops}}


def test_divergence_finds_the_token_where_the_texts_part_and_the_gap_there():
    co, pd = " 12 + 5 = 17", " 12 + 5 = 18"
    rerun = _rerun([" 12", " +", " 5", " =", " 1", "7"], [{}, {}, {}, {}, {}, {"7": -0.70, "8": -0.75}])
    found = gate.divergence(pd, co, rerun)
    assert (found["char"], found["token_index"]) == (11, 5)
    assert abs(found["top2_gap"] - 0.05) < 1e-9 and found["near_tie"] is True
    assert found["pd_took_runner_up"] is True and found["rerun_matches_colocated_up_to_it"] is True


def test_a_wide_gap_is_no_near_tie():
    found = gate.divergence(" R", " The", _rerun([" The"], [{" The": -0.0001, " R": -11.2}]))
    assert found["token_index"] == 0 and found["near_tie"] is False and found["pd_took_runner_up"] is True


def test_a_text_that_stops_early_parts_at_the_end_of_sequence_token():
    # colocated ended (end-of-sequence token, no text); P/D went on
    co, pd = "17", "17 and"
    found = gate.divergence(pd, co, _rerun(["1", "7", ""], [{}, {}, {"": -0.01, " and": -0.06}]))
    assert found["token_index"] == 2 and found["near_tie"] is True and found["pd_took_runner_up"] is True


def test_verdict_needs_the_gate_and_every_disagreement_at_a_near_tie():
    tie, wide = {"near_tie": True}, {"near_tie": False}
    assert gate.verdict(0, 0, []) == "PASS"
    assert gate.verdict(0, 1, [tie]) == "PASS"
    assert gate.verdict(0, 1, [wide]) == "FAIL"  # gate passed, but a disagreement is a real difference
    assert gate.verdict(0, 2, [tie]) == "FAIL"  # not every disagreement explained
    assert gate.verdict(1, 600, [wide] * 20) == "FAIL"
    assert gate.verdict(3, 0, []) == "ERROR"


def test_cudagraph_steps_are_summed_over_every_stats_table(tmp_path):
    from hybrid_pd.bench.gpu.pd_check import cudagraph_steps_by_mode

    log = tmp_path / "decode.log"
    log.write_text(
        "INFO **CUDAGraph Stats:**\n| 1 | 1 | 0 | FULL | 3 |\n| 40 | 40 | 0 | NONE | 1 |\n"
        "INFO **CUDAGraph Stats:**\n| 8 | 8 | 0 | CUDAGraphMode.FULL | 2 |\n| 3 | 4 | 1 | PIECEWISE | 5 |\n"
    )
    assert cudagraph_steps_by_mode(log) == {"FULL": 5, "NONE": 1, "PIECEWISE": 5}


def test_the_configurations_expect_the_control_to_fail_and_the_fallbacks_to_pass():
    assert {name: expected for name, (_env, _flags, expected) in gate.CONFIGS.items()} == {
        "shipped": "PASS", "control": "FAIL", "control+connector": "PASS", "control+piecewise": "PASS",
    }  # fmt: skip
    assert gate.CONFIGS["control"][0] == {"HYBRID_PD_TEST_ONLY_DISABLE_DECODE_ROW_FIX": "1"}
