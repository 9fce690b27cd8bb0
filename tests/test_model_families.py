"""The model-matrix builders (hybrid_pd/models/families.py): registered architectures, real patterns, the embedded tokenizer."""

import json
import re
from pathlib import Path

import pytest

from hybrid_pd.models.families import FAMILIES, build, main, parse_args

REGISTRY = Path(__import__("vllm").__file__).parent / "model_executor" / "models" / "registry.py"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_is_an_architecture_vllm_serves(name):
    assert f'"{FAMILIES[name].architecture}":' in REGISTRY.read_text()


def test_bamba_is_not_in_the_matrix_because_vllm_removed_it():
    """docs/models.md says vLLM 0.32 lists BambaForCausalLM among removed models: keep that true."""
    removed = re.search(r'"BambaForCausalLM": "([0-9.]+)"', REGISTRY.read_text())
    assert removed and not any(f.architecture == "BambaForCausalLM" for f in FAMILIES.values())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_configs_are_tiny_and_keep_a_hybrid_pattern(name, tmp_path):
    from hybrid_pd.connector.plan import model_shape

    cfg = FAMILIES[name].config()
    assert (cfg.get_text_config().hidden_size, cfg.get_text_config().vocab_size) == (128, 512)
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    shape = model_shape(tmp_path)
    assert shape.mamba_layers >= 2 and shape.attention_layers >= 1


def test_build_writes_fp32_weights_and_the_embedded_tokenizer(tmp_path):
    out = build("nemotron_h", tmp_path / "nemotron_h")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"] and config["dtype"] == "float32"
    assert config["layers_block_type"].count("full_attention") == 1 and config["layers_block_type"].count("linear_attention") == 3
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").exists()
    assert len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]) == 512


def test_max_position_goes_into_config_json_and_changes_no_weight(tmp_path, capsys):
    """``--max-position 65536`` instead of a hand edit of config.json: NemotronH has no position embedding, so the
    checkpoint is the same but for the context vLLM accepts."""
    from safetensors.torch import load_file

    assert main([str(tmp_path / "long"), "nemotron_h", "--max-position", "65536"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "long" / "nemotron_h")
    default = build("nemotron_h", tmp_path / "default" / "nemotron_h")
    long_config = json.loads((tmp_path / "long" / "nemotron_h" / "config.json").read_text())
    default_config = json.loads((default / "config.json").read_text())
    assert (long_config.pop("max_position_embeddings"), default_config.pop("max_position_embeddings")) == (65536, 4096)
    assert long_config == default_config
    long_weights, default_weights = load_file(tmp_path / "long" / "nemotron_h" / "model.safetensors"), load_file(default / "model.safetensors")
    assert long_weights.keys() == default_weights.keys() and all((long_weights[k] == default_weights[k]).all() for k in long_weights)


def test_the_cli_takes_one_scale_a_positive_max_position_and_known_families(capsys):
    args = parse_args(["/tmp/full", "--full", "nemotron_h", "--max-position", "65536"])
    assert (args.scale, args.families, args.max_position, args.mtp) == ("full", ["nemotron_h"], 65536, False)
    assert (parse_args(["/tmp/x"]).scale, parse_args(["/tmp/x"]).max_position) == ("tiny", None)
    for argv, error in ((["/tmp/x", "--full", "--published"], "not allowed with"), (["/tmp/x", "--max-position", "0"], "positive"),
                        (["/tmp/x", "nemotron"], "unknown nemotron")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert error in capsys.readouterr().err


def test_qwen35_cannot_load_in_the_cpu_venv_as_recorded():
    """vLLM's qwen3_5.py imports its vision half (qwen3_vl -> transformers' image processor -> torchvision),
    which the CPU install removes (docs/models.md). The day this loads, move Qwen3.5 into the CPU matrix."""
    from vllm.model_executor.models.registry import ModelRegistry

    with pytest.raises(ModuleNotFoundError, match=FAMILIES["qwen3_5"].cpu_expected_error):
        ModelRegistry._try_load_model_cls(FAMILIES["qwen3_5"].architecture) or __import__("vllm.model_executor.models.qwen3_5")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_published_scale_keeps_the_published_hidden_size_and_the_tiny_layer_pattern(name, tmp_path):
    """The GPU matrix's checkpoints: the hidden size ``published`` names, the same layers as the tiny build."""
    from hybrid_pd.connector.plan import model_shape

    family = FAMILIES[name]
    published = family.config("published")
    assert published.get_text_config().hidden_size == int(re.search(r"hidden (\d+)", family.published).group(1))
    shapes = []
    for scale, cfg in (("tiny", family.config()), ("published", published)):
        (tmp_path / scale).mkdir()
        (tmp_path / scale / "config.json").write_text(cfg.to_json_string())
        shapes.append(model_shape(tmp_path / scale))
    tiny, real = shapes
    assert (real.mamba_layers, real.attention_layers) == (tiny.mamba_layers, tiny.attention_layers)


def test_full_scale_nemotron_h_is_the_published_8b_but_its_vocabulary(tmp_path):
    """The real-scale checkpoint: Nemotron-H-8B-Base-8K's 8,100,852,736 parameters less the LM head and
    embedding rows our 512-token tokenizer cannot use, and its 24 Mamba2 / 4 attention layers."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybrid_pd.connector.plan import model_shape

    cfg = FAMILIES["nemotron_h"].config("full")
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    assert params == 8_100_852_736 - 2 * (131_072 - 512) * 4096
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    shape = model_shape(tmp_path)
    assert (shape.mamba_layers, shape.attention_layers, shape.mamba_heads, shape.kv_heads) == (24, 4, 128, 8)


def test_full_scale_is_refused_for_a_family_without_its_published_layers():
    with pytest.raises(ValueError, match="no full-scale config; families with one: nemotron_h"):
        FAMILIES["zamba2"].config("full")


def test_an_mtp_head_is_written_under_the_names_vllms_qwen3_next_mtp_loads(tmp_path):
    from safetensors.torch import load_file

    out = build("qwen3_next", tmp_path / "q", mtp=True)
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    weights = load_file(out / "model.safetensors")
    layer = config["layer_types"].index("full_attention")
    main = {k.removeprefix(f"model.layers.{layer}."): v for k, v in weights.items() if k.startswith(f"model.layers.{layer}.")}
    head = {k.removeprefix("mtp.layers.0."): v for k, v in weights.items() if k.startswith("mtp.layers.0.")}
    assert {k: v.shape for k, v in head.items()} == {k: v.shape for k, v in main.items()}  # a full-attention layer, MoE included
    hidden = config["hidden_size"]
    assert weights["mtp.fc.weight"].shape == (hidden, 2 * hidden)
    assert {k for k in weights if k.startswith("mtp.") and "layers" not in k} == {
        "mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight"}
    assert not weights["mtp.norm.weight"].any()  # Qwen3-Next's norms scale by 1 + w: zero is the identity
    with pytest.raises(ValueError, match="no MTP head"):
        build("falcon_h1", tmp_path / "f", mtp=True)


def test_qwen35_is_built_as_the_published_multimodal_checkpoint_with_its_head_in_the_language_half(tmp_path):
    """As Qwen3.5 ships: Qwen3_5ForConditionalGeneration, the hybrid as text_config, a vision tower, the weight
    names vLLM's Qwen3-VL mapper reads; the MTP head (``mtp.*``, what vLLM's Qwen3_5MTP loads) counted in text_config."""
    from safetensors.torch import load_file

    from hybrid_pd.connector.plan import model_shape

    out = build("qwen3_5", tmp_path / "q", mtp=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["vision_config"]["out_hidden_size"]) == (
        ["Qwen3_5ForConditionalGeneration"], "qwen3_5", config["text_config"]["hidden_size"])
    assert config["text_config"]["mtp_num_hidden_layers"] == 1 and "mtp_num_hidden_layers" not in config
    weights = load_file(out / "model.safetensors")
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in weights} == {"model.language_model", "model.visual", "lm_head.weight", "mtp.layers", "mtp.fc", "mtp.norm", "mtp.pre_fc_norm_hidden", "mtp.pre_fc_norm_embedding"}
    layer = config["text_config"]["layer_types"].index("full_attention")
    main = {k.removeprefix(f"model.language_model.layers.{layer}."): v.shape for k, v in weights.items() if k.startswith(f"model.language_model.layers.{layer}.")}
    assert {k.removeprefix("mtp.layers.0."): v.shape for k, v in weights.items() if k.startswith("mtp.layers.0.")} == main
    shape = model_shape(out)
    assert (shape.multimodal, shape.state_kind, shape.mamba_layers, shape.attention_layers, shape.mtp_attention_layers) == (True, "gdn", 3, 1, 1)


def test_an_mtp_head_is_written_under_the_names_vllms_nemotron_h_mtp_loads(tmp_path):
    """vLLM's NemotronHMTP: ``mtp.layers.0.*`` an attention layer with enorm, hnorm, eh_proj and final_layernorm."""
    from safetensors.torch import load_file

    out = build("nemotron_h", tmp_path / "n", mtp=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_nextn_predict_layers"], config["mtp_layers_block_type"]) == (1, ["full_attention"])  # pattern "*"
    weights = load_file(out / "model.safetensors")
    layer = config["layers_block_type"].index("full_attention")
    main = {k.removeprefix(f"backbone.layers.{layer}."): v.shape for k, v in weights.items() if k.startswith(f"backbone.layers.{layer}.")}
    head = {k.removeprefix("mtp.layers.0."): v for k, v in weights.items() if k.startswith("mtp.layers.0.")}
    hidden = config["hidden_size"]
    assert {k: v.shape for k, v in head.items()} == {
        **main, "eh_proj.weight": (hidden, 2 * hidden), "enorm.weight": (hidden,), "hnorm.weight": (hidden,), "final_layernorm.weight": (hidden,)}
    assert all((head[n] == 1).all() for n in ("norm.weight", "enorm.weight", "hnorm.weight", "final_layernorm.weight"))  # NemotronH scales by w
    assert not any(k.startswith("mtp.") and not k.startswith("mtp.layers.0.") for k in weights)
