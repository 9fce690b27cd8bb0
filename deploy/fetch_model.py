"""Make the model both workers serve available before they start.

The ``model`` service of the compose files runs this once, then the prefill and
decode workers start from the same files. ``MODEL`` is one of:

- empty: the embedded default model, shipped with the package (``hybrid_pd/models/hybrid-pd-tiny``):
  checked;
- an absolute path (a directory of ``MODEL_DIR``, mounted at ``/models``): checked;
- a Hugging Face id (``org/name``): downloaded into ``$HF_HOME`` with ``$HF_TOKEN``.

Workers start vLLM offline (``HF_HUB_OFFLINE=1``), so a hub model is fetched here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["prepare", "main"]

# Consolidated checkpoints some repositories ship beside the Hugging Face weights; vLLM never reads them.
_IGNORE = ["original/*"]


def prepare(model: str, token: str | None = None) -> Path:
    """Return the directory ``model`` will be served from, building or downloading it first.

    Raises SystemExit with a message a person can act on when a local path holds no model.
    """
    if not model:
        from hybrid_pd.default_model import ensure_default_model

        return ensure_default_model()
    if model.startswith("/"):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise SystemExit(
                f"{path / 'config.json'} not found: a local MODEL must be a model directory "
                "inside MODEL_DIR, which is mounted at /models"
            )
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, token=token or None, ignore_patterns=_IGNORE))


def main() -> int:
    model = os.environ.get("MODEL", "")
    path = prepare(model, os.environ.get("HF_TOKEN"))
    print(f"model ready: {model or 'embedded default'} -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
