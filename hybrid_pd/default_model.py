"""The embedded default model: ``hybrid-pd-tiny``, a small trained hybrid shipped with the package.

No model hub is reachable, so ``hybrid-pd up`` without ``--model`` serves the model
directory that ships as package data in ``hybrid_pd/models/hybrid-pd-tiny``: a NemotronH
hybrid (Mamba2, attention and MLP layers) trained on synthetic GSM8K-format word problems
by :mod:`hybrid_pd.models.train`, with a digit-level BPE tokenizer and a chat template. It is
an ordinary Hugging Face model directory that vLLM loads through its normal path.

Every service resolves the default here, to the same packaged bytes, so a prefill and a
decode worker started without ``--model`` (in two containers, say) serve identical weights.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_MODEL_NAME", "DEFAULT_PROFILES", "default_model_dir", "ensure_default_model", "resolve_model"]

DEFAULT_MODEL_NAME = "hybrid-pd-tiny"
# The embedded model's profiles (hybrid_pd/sizing/profiles/) by device: the planner of `hybrid-pd up --flex N` uses them.
DEFAULT_PROFILES = {"cpu": "tiny-cpu"}

# What vLLM needs from the directory.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_dir() -> Path:
    """Where the default model lives: the package data directory ``hybrid_pd/models/hybrid-pd-tiny``."""
    return Path(__file__).resolve().parent / "models" / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """Return the default model's directory, after checking that the package data is all there."""
    target = default_model_dir()
    missing = [name for name in _REQUIRED_FILES if not (target / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the embedded default model {target} lacks {', '.join(missing)}: reinstall hybrid-pd with its "
            "package data, rebuild it with `python -m hybrid_pd.models.train`, or pass --model"
        )
    return target


def resolve_model(model: str | None, served_model_name: str | None = None) -> tuple[str, str]:
    """``(model path, served name)``: the given model, or the embedded default when none is given.

    Every service resolves the default the same way, so a prefill and a decode
    worker started without ``--model`` (in two containers, say) serve identical bytes.
    """
    if model:
        return model, served_model_name or model
    return str(ensure_default_model()), served_model_name or DEFAULT_MODEL_NAME
