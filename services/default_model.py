"""The embedded default model: a tiny NemotronH-style hybrid built locally.

No model hub is reachable, so ``hybrid-pd up`` without ``--model`` serves a model
that this module builds deterministically on first use: Mamba2 and attention
layers (pattern ``M*M-``: mamba, attention, mamba, mlp), random weights from a
fixed seed, and a byte-level BPE tokenizer trained on a fixed corpus with a chat
template. The result is an ordinary Hugging Face model directory that vLLM loads
through its normal path.

This module is the only place that knows how the default model is made, so a
trained replacement only has to change :func:`build_default_model`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["DEFAULT_MODEL_NAME", "build_default_model", "default_model_dir", "ensure_default_model", "resolve_model"]

DEFAULT_MODEL_NAME = "hybrid-pd-tiny"

# The layer pattern and shape. Heads and groups are even so tensor parallel 2 splits them.
_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    layers_block_type=["mamba", "attention", "mamba", "mlp"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    mamba_num_heads=8,
    mamba_head_dim=32,
    n_groups=2,
    ssm_state_size=32,
    conv_kernel=4,
    chunk_size=128,
    max_position_embeddings=4096,
    use_mamba_kernels=False,
    initializer_range=0.05,
    tie_word_embeddings=False,
)
_SEED = 0

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across workers.",
    "A state space model keeps a fixed-size state per sequence.",
    "Mamba layers mix with attention layers in hybrid models.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 + - * / = ( ) < > ####",
    "Hello! How are you today? I am fine, thank you. What can I do for you?",
    "The system prompt tells the assistant what to do. The user asks a question.",
]


def _fingerprint() -> str:
    """A short hash of everything that determines the model's bytes."""
    recipe = json.dumps([_CONFIG, _SEED, _CHAT_TEMPLATE, _SPECIAL_TOKENS, _CORPUS], sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def default_model_dir() -> Path:
    """Where the default model lives: ``$HYBRID_PD_HOME/models/...`` (default ``~/.cache/hybrid-pd``)."""
    home = Path(os.environ.get("HYBRID_PD_HOME", Path.home() / ".cache" / "hybrid-pd"))
    return home / "models" / f"{DEFAULT_MODEL_NAME}-{_fingerprint()}"


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_CONFIG["vocab_size"],
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        model_max_length=_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_default_model(out: Path) -> None:
    """Write the default model (config, safetensors weights, tokenizer) into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, NemotronHConfig

    _build_tokenizer(out)
    config = NemotronHConfig(
        **_CONFIG,
        pad_token_id=_SPECIAL_TOKENS.index("<|pad|>"),
        bos_token_id=_SPECIAL_TOKENS.index("<|bos|>"),
        eos_token_id=_SPECIAL_TOKENS.index("<|eos|>"),
        architectures=["NemotronHForCausalLM"],
    )
    torch.manual_seed(_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)


def ensure_default_model() -> Path:
    """Return the default model's directory, building it first if it is missing.

    The build goes to a temporary directory that is renamed into place, so
    concurrent callers never see a half-written model.
    """
    target = default_model_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build_default_model(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str | None, served_model_name: str | None = None) -> tuple[str, str]:
    """``(model path, served name)``: the given model, or the embedded default when none is given.

    Every service resolves the default the same way, so a prefill and a decode
    worker started without ``--model`` (in two containers, say) serve identical bytes.
    """
    if model:
        return model, served_model_name or model
    return str(ensure_default_model()), served_model_name or DEFAULT_MODEL_NAME
