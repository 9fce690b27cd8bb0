"""Prompts as token-id lists: exactly ``input_len`` tokens, random ids from a seed, inside the vocabulary.

Token ids (not text) make the prompt length exact whatever the tokenizer: vLLM takes
``"prompt": [ids...]`` as is. The vocabulary bound comes from ``--vocab-size``, else from the
model directory the endpoint reports in ``/v1/models`` (``root``) when that directory is
readable here (a local stack), else :data:`FALLBACK_VOCAB_SIZE`, which every byte-level
tokenizer covers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ["FALLBACK_VOCAB_SIZE", "random_prompts", "vocab_size_of"]

FALLBACK_VOCAB_SIZE = 256


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` ids drawn uniformly from ``[0, vocab_size)``; the same for the same seed."""
    if count < 0 or length < 1 or vocab_size < 1:
        raise ValueError(f"need count >= 0, length >= 1, vocab_size >= 1; got {count}, {length}, {vocab_size}")
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def vocab_size_of(model_dir: str | Path | None) -> int | None:
    """The number of token ids a model's tokenizer accepts, read from its directory; None if unknown.

    vLLM refuses prompt ids above the tokenizer's largest id, which can be below the
    embedding size (``config.json``'s ``vocab_size``, often padded): so the tokenizer's
    largest id + 1 when ``tokenizer.json`` is there, bounded by ``vocab_size``.
    """
    if not model_dir:
        return None
    directory = Path(model_dir)
    if not directory.is_dir():
        return None
    sizes: list[int] = []
    tokenizer = _read_json(directory / "tokenizer.json")
    if tokenizer is not None:
        vocab = (tokenizer.get("model") or {}).get("vocab") or {}
        # BPE/WordPiece: {token: id}; Unigram: [[piece, score], ...] where the id is the position.
        ids = [i for i in vocab.values() if isinstance(i, int)] if isinstance(vocab, dict) else [len(vocab) - 1] * bool(vocab)
        ids += [t["id"] for t in tokenizer.get("added_tokens") or [] if isinstance(t.get("id"), int)]
        if ids:
            sizes.append(max(ids) + 1)
    config = _read_json(directory / "config.json")
    if config is not None:
        size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        if isinstance(size, int) and size > 0:
            sizes.append(size)
    return min(sizes) if sizes else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
