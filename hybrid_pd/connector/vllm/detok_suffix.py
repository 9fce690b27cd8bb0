"""A request's first token without detokenizing its whole prompt: vLLM's stream primed with the prompt's last tokens.

vLLM (0.26 on GPU, 0.32 on CPU) primes each request's ``tokenizers`` ``DecodeStream`` with the whole prompt
(``FastIncrementalDetokenizer.__init__``: ``DecodeStream(ids=prompt_token_ids)``), and the stream's first ``step()``
decodes all of it: on the request's first token, in the API server's event loop, where every other stream's output
waits meanwhile. Measured on an H100 (docs/performance.md, "Inside vLLM's decode-row step"): the first token's
``process_outputs`` took 0.76 ms at 1,000 prompt tokens and 3.85 ms at 8,000 with our 512-token tokenizer; on CPU a
131k-token byte-level BPE costs 0.4 ms per 1,000 prompt tokens (~15 ms for a 32k-token document). Every P/D request
pays it twice (the prefill's one token, the decode's first), a colocated one once.

What a stream emits for a new token is the text the token adds to the decoded ids before it; for the decoders of
Hugging Face tokenizers (byte-level BPE, Metaspace) that depends only on the last few ids, so a stream
primed with the prompt's last :data:`SUFFIX_TOKENS` emits the same text, and after its first token holds the same
state (both keep only the ids since their last emitted text). Where the suffix decodes to nothing or ends inside a
character (the prompt's own end is then broken, and vLLM's stream emits the prompt's text with the first token), the
whole prompt primes the stream as vLLM does: :func:`prime_ids` says which, the equality is tested against vLLM's own
detokenizer on text and random-id prompts (``tests/test_detok_suffix.py``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

__all__ = ["DOES", "SUFFIX_TOKENS", "apply", "prime_ids", "probe"]

SUFFIX_TOKENS = 24  # as vLLM primed before it primed with the whole prompt: enough for any character's bytes
DOES = f"each stream is primed with the prompt's last {SUFFIX_TOKENS} tokens instead"


def prime_ids(tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> list[int] | None:
    """The ids to prime a request's stream with: the prompt's last :data:`SUFFIX_TOKENS`, or None to keep the whole prompt.

    ``tokenizer`` is a ``tokenizers.Tokenizer``. None where the prompt is no longer than the suffix (nothing to save)
    or the suffix decodes to nothing or to a broken character at its end (there vLLM's stream emits prompt text, which
    a suffix would not).
    """
    if len(prompt_ids) <= SUFFIX_TOKENS:
        return None
    suffix = list(prompt_ids[-SUFFIX_TOKENS:])
    text = tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens)
    return suffix if text and not text.endswith("\ufffd") else None


def _primes_with_the_prompt(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False
    return "DecodeStream(" in source and "ids=request.prompt_token_ids" in source


def probe() -> str | None:
    """Why this vLLM needs the fix (its fast detokenizer primes each stream with the whole prompt), or None."""
    from vllm.v1.engine import detokenizer

    cls = getattr(detokenizer, "FastIncrementalDetokenizer", None)
    if cls is None or getattr(cls.__init__, "_hybrid_pd_suffix", False) or not _primes_with_the_prompt(cls):
        return None
    return "vLLM's detokenizer decodes each request's whole prompt on its first token"


def apply() -> None:
    """vLLM's fast detokenizer primes each new stream with :func:`prime_ids` where that is the same text."""
    import tokenizers
    from vllm.v1.engine import detokenizer

    cls = detokenizer.FastIncrementalDetokenizer
    vllms_init = cls.__init__

    @functools.wraps(vllms_init)
    def __init__(self: Any, tokenizer: Any, request: Any) -> None:
        vllms_init(self, tokenizer, request)  # primes with the whole prompt: cheap until its first step
        ids = prime_ids(self.tokenizer, request.prompt_token_ids or (), self.skip_special_tokens)
        if ids is not None:
            self.stream = tokenizers.decoders.DecodeStream(ids=ids, skip_special_tokens=self.skip_special_tokens)

    __init__._hybrid_pd_suffix = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
