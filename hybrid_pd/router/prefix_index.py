"""Which worker can resume which prompt prefix: the router's own record of where it sent each prompt.

A hybrid model resumes a prompt only from a Mamba/GDN state checkpoint, and vLLM stores those
at its prefix-cache blocks (Mamba cache modes ``all`` and ``align``: hundreds to ~2,000 tokens a
block for these families). Attention blocks that match without a checkpoint at their end reuse
nothing: the state must still be computed from the start. So what a worker can reuse of a prompt
is the prefix it has seen, rounded down to its hit granule (what its vLLM reports in
``vllm:cache_config_info``; :func:`hybrid_pd.common.prom.prefix_hit_tokens`), and nothing when its
prefix caching is off.

The router keeps no tokenizer. A prompt is cut into grains of :data:`GRAIN_TOKENS` tokens (token-id
prompts) or of that many times :data:`CHARS_PER_TOKEN` characters (text, the size estimate
:class:`hybrid_pd.router.policies.RequestInfo` uses), hashed as a chain, so a grain's hash stands
for the whole prefix up to it. Each worker's registry entry keeps the chains sent to it in an LRU
bounded in tokens; the worker's own evictions are not seen, so a stale entry costs one choice a hit
it did not get.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["CHARS_PER_TOKEN", "GRAIN_TOKENS", "SentPrefixes", "prefix_chain", "reusable_tokens"]

# Matches are found to this many tokens; far below any hybrid's checkpoint block, so rounding
# to the worker's granule, not the grain, decides what is reusable.
GRAIN_TOKENS = 16
CHARS_PER_TOKEN = 4


def prefix_chain(prompt: str | Sequence[int]) -> list[int]:
    """Chained hashes of the prompt's whole grains: entry i stands for the prompt's first (i + 1) grains."""
    text = isinstance(prompt, str)
    step = GRAIN_TOKENS * CHARS_PER_TOKEN if text else GRAIN_TOKENS
    grains = (prompt[start : start + step] for start in range(0, len(prompt) - step + 1, step))
    chain, previous = [], 0
    for grain in grains if text else map(tuple, grains):
        previous = hash((previous, grain))
        chain.append(previous)
    return chain


def reusable_tokens(matched_grains: int, prompt_tokens: int, granule: int | None) -> int:
    """Tokens a worker resumes from a checkpoint: the matched prefix rounded down to ``granule``, short of the whole prompt.

    vLLM computes at least the prompt's last token itself, so a hit never covers all of it; a
    worker without prefix caching (``granule`` None) reuses nothing.
    """
    if not granule:
        return 0
    matched = min(matched_grains * GRAIN_TOKENS, prompt_tokens - 1)
    return max(matched, 0) // granule * granule


class SentPrefixes:
    """The prefix chains one worker was sent, most recent last; it lives and goes with the worker's registry entry."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: OrderedDict[int, None] = OrderedDict()

    def matched_grains(self, chain: Sequence[int]) -> int:
        """How many leading grains of ``chain`` the worker was sent."""
        seen = self._seen
        for i, grain in enumerate(chain):
            if grain not in seen:
                return i
        return len(chain)

    def record(self, chain: Sequence[int], capacity_tokens: int) -> None:
        """The worker now holds ``chain``: its grains become the most recent; the oldest beyond ``capacity_tokens`` go."""
        seen = self._seen
        for grain in chain:
            seen[grain] = None
            seen.move_to_end(grain)
        for _ in range(len(seen) - max(capacity_tokens // GRAIN_TOKENS, 1)):
            seen.popitem(last=False)
