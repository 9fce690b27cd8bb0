"""The PASS/FAIL logic of hybrid_pd/bench/gpu/model_matrix.py (the GPU run itself needs an NVIDIA GPU)."""

import pytest

from hybrid_pd.bench.gpu.gsm8k_gate import NEAR_TIE
from hybrid_pd.bench.gpu.model_matrix import log_errors, one_full_decode_row, prompt_ids, verdict, with_text_config
from hybrid_pd.connector.plan import ModelShape, plan_transfer

CLEAN = {"transfers": 1, "planned_transfers": 1, "failed_transfers": 0, "fallbacks": 0, "bytes": 4096, "planned_bytes": 4096,
         "first_divergence": None, "top2_gap_at_divergence": None}  # fmt: skip
FULL_ROW = {"one_full_1_token_step": True}


def test_a_family_passes_with_clean_transfers_of_the_planned_bytes_and_a_full_decode_row():
    near_tie = {**CLEAN, "first_divergence": 9, "top2_gap_at_divergence": NEAR_TIE / 2}
    assert verdict({"prompts": [CLEAN, near_tie], "decode_row": FULL_ROW}) == "PASS"


@pytest.mark.parametrize(
    "broken",
    [{"bytes": 4095}, {"transfers": 2}, {"transfers": 0}, {"failed_transfers": 1}, {"fallbacks": 1},
     {"first_divergence": 0, "top2_gap_at_divergence": 8.6}],  # fmt: skip
)
def test_any_unclean_prompt_fails_the_family(broken):
    assert verdict({"prompts": [CLEAN, {**CLEAN, **broken}], "decode_row": FULL_ROW}) == "FAIL"


def test_heterogeneous_tp_expects_one_transfer_per_prefill_rank_a_decode_rank_reads():
    """The earlier two-H200 run counted 2 per request in both directions (hybrid_pd/bench/results/2026-11-23-h200x2-hetero-tp.json)."""
    shape = ModelShape(mamba_layers=2, attention_layers=1, d_inner=256, groups_state=64, conv_rows=3, mamba_heads=8,
                       mamba_head_dim=32, state_size=32, kv_heads=2, head_dim=32, dtype_bytes=2, ssm_dtype_bytes=4)  # fmt: skip
    counts = {tp: plan_transfer(shape, 300, prefill_tp=tp[0], decode_tp=tp[1]).transfers for tp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 2))}
    assert counts == {(1, 1): 1, (2, 1): 2, (1, 2): 2, (2, 2): 2, (4, 2): 4}
    two = {**CLEAN, "transfers": 2, "planned_transfers": 2}
    assert verdict({"prompts": [two], "decode_row": FULL_ROW}) == "PASS"
    assert verdict({"prompts": [{**two, "transfers": 1}], "decode_row": FULL_ROW}) == "FAIL"


def test_with_speculation_the_bytes_are_checked_too():
    """The plan counts the MTP head's KV (hybrid_pd.connector.plan.Speculation): one layer's KV more than planned is a FAIL."""
    mtp_bytes = {**CLEAN, "bytes": CLEAN["planned_bytes"] + 163_840}
    assert verdict({"prompts": [mtp_bytes], "decode_row": FULL_ROW, "speculative_config": '{"method":"mtp"}'}) == "FAIL"
    assert verdict({"prompts": [CLEAN], "decode_row": FULL_ROW, "speculative_config": '{"method":"mtp"}'}) == "PASS"


def test_a_multimodal_checkpoints_image_request_must_be_refused():
    """Its P/D workers serve the text half: an image answered 200 was dropped or went through an unchecked hand-off."""
    for status, expected in ((400, "PASS"), (200, "FAIL"), (500, "FAIL")):
        assert verdict({"prompts": [CLEAN], "decode_row": FULL_ROW, "image_request": {"status": status}}) == expected


def test_no_full_decode_row_or_no_prompts_fails():
    assert verdict({"prompts": [CLEAN], "decode_row": {"one_full_1_token_step": False}}) == "FAIL"
    assert verdict({"error": "RuntimeError: decode did not start"}) == "FAIL"


def test_the_decode_row_is_one_new_1_token_full_step():
    warm = [(1, 1, "FULL", 4)]
    assert one_full_decode_row(warm, [(1, 1, "CUDAGraphMode.FULL", 1)])
    assert not one_full_decode_row(warm, warm)  # nothing new logged
    assert not one_full_decode_row(warm, [(1, 1, "PIECEWISE", 1)])  # token N outside a FULL graph
    assert not one_full_decode_row(warm, [(1000, 1024, "PIECEWISE", 1)])  # the prompt computed locally
    assert not one_full_decode_row(warm, [(1, 1, "FULL", 1), (999, 1024, "NONE", 1)])


def test_prompt_ids_avoid_special_tokens_and_fit_the_vocabulary():
    ids = prompt_ids(3000, 512)
    assert len(ids) == 3000 and min(ids) >= 10 and max(ids) < 512


def test_a_servers_error_lines_are_the_last_that_say_why_not_vllms_ulimit_warning(tmp_path):
    log = tmp_path / "decode.log"
    log.write_text("\n".join([
        "INFO starting",
        "WARNING Found ulimit of 20000 ... This can cause fd limit errors like `OSError: [Errno 24] Too many open files`.",
        "Traceback (most recent call last):",
        "RuntimeError: NIXL compatibility hash mismatch",
        "INFO shutting down",
    ]))  # fmt: skip
    assert log_errors(log) == ["Traceback (most recent call last):", "RuntimeError: NIXL compatibility hash mismatch"]
    assert log_errors(log, limit=1) == ["RuntimeError: NIXL compatibility hash mismatch"]
    assert log_errors(tmp_path / "never-written.log") == []


def test_a_text_config_diagnostic_lands_in_the_language_config(tmp_path):
    """--text-config changes what the engine reads: a multimodal checkpoint's text_config, else the config itself."""
    import json

    for config, language in (({"text_config": {"num_experts_per_tok": 2}, "vision_config": {}}, lambda c: c["text_config"]),
                             ({"num_experts_per_tok": 2}, lambda c: c)):  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps(config))
        with_text_config(tmp_path, {"num_experts_per_tok": 8})
        assert language(json.loads((tmp_path / "config.json").read_text()))["num_experts_per_tok"] == 8
