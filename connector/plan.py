"""What crosses NIXL for one request: bytes, reads per rank, time at a bandwidth.

For a prompt of N tokens the prefill computes N-1 and the decode worker pulls:

- per Mamba layer, the conv state in the DS layout, read as three slices
  (``|-- x --|- B -|- C -|``, each ``dim x (conv_kernel - 1)``), and the SSM state
  (``heads x head_dim x state_size``, in the SSM cache dtype);
- per attention layer, K and V of every block the N-1 tokens occupy (whole blocks,
  one read per block: a block's page holds both).

With heterogeneous TP each decode rank reads its slice from the prefill rank(s)
that hold it: D >= P reads one prefill rank (a 1/(D/P) slice of its state),
P > D reads P/D prefill ranks whole. This module reads the model's config.json
and does the arithmetic; ``hybrid-pd plan`` prints it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ModelShape", "PlanError", "TransferPlan", "model_shape", "plan_transfer"]


class PlanError(ValueError):
    """The model's config or the layout asked for cannot be planned; the message says what to give instead."""


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    """The state-relevant shape of a hybrid model."""

    mamba_layers: int
    attention_layers: int
    d_inner: int  # x part of the conv state: mamba heads x head dim
    groups_state: int  # B (= C) part of the conv state: n_groups x state size
    conv_rows: int  # conv_kernel - 1
    mamba_heads: int
    mamba_head_dim: int
    state_size: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    ssm_dtype_bytes: int


def _layer_kinds(cfg: dict) -> list[str]:
    for key in ("layers_block_type", "layer_types"):
        if isinstance(cfg.get(key), list):
            return [str(k) for k in cfg[key]]
    if isinstance(cfg.get("hybrid_override_pattern"), str):
        names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        return [names.get(c, c) for c in cfg["hybrid_override_pattern"]]
    if cfg.get("model_type") in ("mamba2", "mamba"):
        return ["mamba"] * int(cfg["num_hidden_layers"])
    raise PlanError(
        f"cannot find the layer pattern of model_type {cfg.get('model_type')!r}: give a NemotronH, Granite-4-H "
        "or Mamba2 model (layers_block_type, layer_types or hybrid_override_pattern in config.json)"
    )


def model_shape(config_path: str | Path) -> ModelShape:
    """Read ``config.json`` (a file or a model directory) of a NemotronH, Granite-4-H or Mamba2 model."""
    path = Path(config_path)
    file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(file.read_text())
    except FileNotFoundError:
        raise PlanError(f"no {file}: give a local model directory (or its config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {file} as a model config: {exc}") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{file} is not a model config (a JSON object)")
    kinds = _layer_kinds(cfg)
    mamba = sum(k in ("mamba", "linear_attention", "M") for k in kinds)
    attention = sum(k in ("attention", "full_attention", "*") for k in kinds)

    def first(*keys: str, default: int | None = None) -> int:
        for key in keys:
            if cfg.get(key) is not None:
                return int(cfg[key])
        if default is None:
            raise PlanError(f"{file} has none of {', '.join(keys)}: is it a hybrid Mamba model's config?")
        return default

    heads = first("mamba_num_heads", "mamba_n_heads", "num_heads")
    head_dim = first("mamba_head_dim", "mamba_d_head", "head_dim")
    groups = first("n_groups", "mamba_n_groups", default=1)
    state = first("ssm_state_size", "mamba_d_state", "state_size")
    kernel = first("conv_kernel", "mamba_d_conv", default=4)
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    ssm_dtype = str(cfg.get("mamba_ssm_cache_dtype") or "float32")
    attn_heads = first("num_attention_heads", default=1)
    return ModelShape(
        mamba_layers=mamba,
        attention_layers=attention,
        d_inner=heads * head_dim,
        groups_state=groups * state,
        conv_rows=kernel - 1,
        mamba_heads=heads,
        mamba_head_dim=head_dim,
        state_size=state,
        kv_heads=first("num_key_value_heads", default=attn_heads),
        head_dim=first("attention_head_dim", "head_dim", default=first("hidden_size") // attn_heads)
        if attention
        else 0,
        dtype_bytes=_DTYPE_BYTES.get(dtype.replace("torch.", ""), 4),
        ssm_dtype_bytes=_DTYPE_BYTES.get(ssm_dtype.replace("torch.", ""), 4),
    )


@dataclass(frozen=True)
class TransferPlan:
    """The state of one request as it crosses from prefill to decode ranks."""

    prompt_tokens: int
    transferred_tokens: int
    blocks: int
    conv_bytes_per_mamba_layer: int
    ssm_bytes_per_mamba_layer: int
    kv_bytes_per_attention_layer: int
    total_bytes: int
    bytes_per_decode_rank: int
    prefill_ranks_per_decode_rank: int
    max_reads_per_decode_rank: int
    decode_rank_sources: dict[int, list[int]]
    seconds_at_bandwidth: float
    bandwidth_gbps: float

    def to_json(self) -> dict:
        return asdict(self)


def plan_transfer(
    shape: ModelShape,
    prompt_tokens: int,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    block_size: int = 128,
    bandwidth_gbps: float = 25.0,
) -> TransferPlan:
    """The plan for one request of ``prompt_tokens`` tokens; TP sizes must divide one another."""
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise PlanError(
            f"TP sizes {prefill_tp} (prefill) and {decode_tp} (decode): one must divide the other, e.g. 2 and 4"
        )
    tokens = max(prompt_tokens - 1, 1)  # the prefill stops at N-1 (one token cannot back off)
    blocks = math.ceil(tokens / block_size)
    conv = (shape.d_inner + 2 * shape.groups_state) * shape.conv_rows * shape.dtype_bytes
    ssm = shape.mamba_heads * shape.mamba_head_dim * shape.state_size * shape.ssm_dtype_bytes
    kv = 2 * blocks * block_size * shape.kv_heads * shape.head_dim * shape.dtype_bytes
    total = shape.mamba_layers * (conv + ssm) + shape.attention_layers * kv
    if decode_tp >= prefill_tp:
        ratio = decode_tp // prefill_tp
        sources = {r: [r // ratio] for r in range(decode_tp)}
    else:
        ratio = prefill_tp // decode_tp
        sources = {r: list(range(r * ratio, (r + 1) * ratio)) for r in range(decode_tp)}
    # x, B, C, SSM per Mamba layer; one K+V page per block (adjacent blocks may go as one descriptor: fewer reads then)
    per_source_reads = shape.mamba_layers * 4 + shape.attention_layers * blocks
    return TransferPlan(
        prompt_tokens=prompt_tokens,
        transferred_tokens=tokens,
        blocks=blocks,
        conv_bytes_per_mamba_layer=conv,
        ssm_bytes_per_mamba_layer=ssm,
        kv_bytes_per_attention_layer=kv,
        total_bytes=total,
        bytes_per_decode_rank=total // decode_tp,
        prefill_ranks_per_decode_rank=len(sources[0]),
        max_reads_per_decode_rank=per_source_reads * len(sources[0]),
        decode_rank_sources=sources,
        seconds_at_bandwidth=total / (bandwidth_gbps * 1e9),
        bandwidth_gbps=bandwidth_gbps,
    )
