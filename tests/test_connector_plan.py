"""The transfer plan's arithmetic (checked against vLLM's own stats in tests/e2e)."""

import json

import pytest

from connector.plan import ModelShape, model_shape, plan_transfer

SHAPE = ModelShape(mamba_layers=2, attention_layers=1, d_inner=256, groups_state=64, conv_rows=3, mamba_heads=8,
                   mamba_head_dim=32, state_size=32, kv_heads=2, head_dim=32, dtype_bytes=4, ssm_dtype_bytes=4)  # fmt: skip


def test_bytes_per_layer_and_whole_blocks():
    plan = plan_transfer(SHAPE, prompt_tokens=130, block_size=128)
    assert plan.transferred_tokens == 129 and plan.blocks == 2
    assert plan.conv_bytes_per_mamba_layer == (256 + 2 * 64) * 3 * 4
    assert plan.ssm_bytes_per_mamba_layer == 8 * 32 * 32 * 4
    assert plan.kv_bytes_per_attention_layer == 2 * 2 * 128 * 2 * 32 * 4
    assert plan.total_bytes == 2 * (4608 + 32768) + 131072
    assert plan.max_reads_per_decode_rank == 2 * 4 + 2


def test_one_token_prompt_still_moves_one_token():
    assert plan_transfer(SHAPE, prompt_tokens=1).transferred_tokens == 1


@pytest.mark.parametrize(("p", "d", "sources"), [(1, 2, {0: [0], 1: [0]}), (2, 1, {0: [0, 1]}), (2, 4, {0: [0], 1: [0], 2: [1], 3: [1]})])
def test_heterogeneous_tp_read_plan(p, d, sources):
    plan = plan_transfer(SHAPE, 100, prefill_tp=p, decode_tp=d)
    assert plan.decode_rank_sources == sources
    assert plan.bytes_per_decode_rank == plan.total_bytes // d


def test_tp_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="one must divide the other"):
        plan_transfer(SHAPE, 100, prefill_tp=2, decode_tp=3)


def test_reads_nemotron_h_and_pure_mamba2_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-", "mamba_num_heads": 4, "mamba_head_dim": 16,
        "n_groups": 1, "ssm_state_size": 8, "conv_kernel": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 8, "hidden_size": 32, "torch_dtype": "bfloat16"}))  # fmt: skip
    shape = model_shape(tmp_path)
    assert (shape.mamba_layers, shape.attention_layers, shape.dtype_bytes, shape.kv_heads) == (2, 1, 2, 1)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mamba2", "num_hidden_layers": 3, "num_heads": 4, "head_dim": 16, "n_groups": 1,
        "state_size": 8, "conv_kernel": 4, "hidden_size": 32}))  # fmt: skip
    shape = model_shape(tmp_path)
    assert (shape.mamba_layers, shape.attention_layers) == (3, 0)
    assert plan_transfer(shape, 50).total_bytes == 3 * ((64 + 2 * 8) * 3 * 4 + 4 * 16 * 8 * 4)
