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
state (both keep only the ids since their last emitted text). Where the suffix decodes to nothing, the whole prompt
primes the stream as vLLM does.

A prompt whose text ends in U+FFFD (a replacement character, or the bytes of one cut short: random-id prompts, vLLM's
random benchmark prompts, text that was decoded lossily) is where vLLM's stream goes wrong: ``DecodeStream`` holds back
any text that ends in U+FFFD, so primed with such a prompt it emits the *whole prompt's text* with the first token, and
the completion a client gets starts with its prompt (vLLM 0.26 and 0.32; every P/D and colocated server alike). There
the stream is primed with the suffix and its first text loses what the suffix's own text already said
(:class:`Unrepeated`): the tokens' text, as a stream primed with a prompt that ended cleanly gives it; where the
first token completes the prompt's cut character, that character. :func:`priming` says which; the equality with
vLLM's own detokenizer, and the prompt kept out of the text where vLLM repeats it, are tested on text and random-id
prompts (``tests/test_detok_suffix.py``).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DOES", "SUFFIX_TOKENS", "Priming", "Unrepeated", "apply", "priming", "probe"]

SUFFIX_TOKENS = 24  # as vLLM primed before it primed with the whole prompt: enough for any character's bytes
DOES = (f"each stream is primed with the prompt's last {SUFFIX_TOKENS} tokens instead, and a prompt whose text ends in "
        "U+FFFD no longer comes back in its first token's text")  # fmt: skip


@dataclass(frozen=True)
class Priming:
    """How to prime a request's stream: with ``ids``, and where ``said`` is set, without repeating that text."""

    ids: list[int]
    said: str | None = None  # the text of ``ids``, which ends in U+FFFD: a stream primed with them repeats it

    def stream(self, skip_special_tokens: bool) -> Any:
        """The stream primed so: a ``DecodeStream``, or an :class:`Unrepeated` one where ``said`` is set."""
        import tokenizers

        if self.said is not None:
            return Unrepeated(self.ids, self.said, skip_special_tokens)
        return tokenizers.decoders.DecodeStream(ids=self.ids, skip_special_tokens=skip_special_tokens)


def priming(tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> Priming | None:
    """The stream for a request's prompt, or None to keep vLLM's (primed with the whole prompt).

    ``tokenizer`` is a ``tokenizers.Tokenizer``. The prompt's last :data:`SUFFIX_TOKENS` (all of a shorter prompt): as
    they are where their text ends cleanly and the prompt is longer (nothing to save otherwise); without their repeat
    where their text ends in U+FFFD, at any length (vLLM's stream would repeat the whole prompt). None where their
    text is empty (a stream primed so would drop the first token's leading space where a decoder strips it).
    """
    suffix = list(prompt_ids[-SUFFIX_TOKENS:])
    text = tokenizer.decode(suffix, skip_special_tokens=skip_special_tokens) if suffix else ""
    if text.endswith("\ufffd"):
        return Priming(suffix, said=text)
    if not text or len(prompt_ids) <= SUFFIX_TOKENS:
        return None
    return Priming(suffix)


class Unrepeated:
    """A ``DecodeStream`` primed with ids whose text ends in U+FFFD, whose first text loses what those ids said.

    ``DecodeStream`` emits nothing until its text no longer ends in U+FFFD, then all of it since the ids it was primed
    with: ``said`` and what the new tokens add, or, where they complete the character ``said`` ends inside, ``said``
    up to that character and the rest. The common start of the two is cut once; later texts pass as they come.
    """

    def __init__(self, ids: list[int], said: str, skip_special_tokens: bool) -> None:
        import tokenizers

        self._stream = tokenizers.decoders.DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens)
        self._said: str | None = said

    def step(self, tokenizer: Any, token: int | list[int]) -> str | None:
        text = self._stream.step(tokenizer, token)
        if text is None or self._said is None:
            return text
        said, self._said = self._said, None
        return text[len(os.path.commonprefix([text, said])) :]


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
    """vLLM's fast detokenizer primes each new stream as :func:`priming` says."""
    from vllm.v1.engine import detokenizer

    cls = detokenizer.FastIncrementalDetokenizer
    vllms_init = cls.__init__

    @functools.wraps(vllms_init)
    def __init__(self: Any, tokenizer: Any, request: Any) -> None:
        vllms_init(self, tokenizer, request)  # primes with the whole prompt: cheap until its first step
        how = priming(self.tokenizer, request.prompt_token_ids or (), self.skip_special_tokens)
        if how is not None:
            self.stream = how.stream(self.skip_special_tokens)

    __init__._hybrid_pd_suffix = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
