"""A decode worker's local prefix hit that covers every token the prefill hands off, but not their state.

With prefix caching on, vLLM (0.32: ``KVCacheManager.get_computed_blocks_for_connector``) reports a
hybrid's full-attention hit as a P/D request's local prefix even where it runs deeper than the Mamba
or GDN groups' hit: the state at that boundary comes with the pull. When that attention hit covers
all N-1 tokens the prefill hands off, the connector has no token left to pull (its count is 0), so
vLLM's scheduler takes the boundary every group agrees on (often 0) and the decode worker computes
the whole prompt itself: the answer is right, but it is a prefill on the decode worker and no
transfer. It happens whenever a prompt's N-1 ends on a block the decode worker holds attention KV
for without a state checkpoint there: a decode step filled the block (a prompt of a block, then one
of a block + 1 sharing it, measured on every CPU family; docs/connector.md).

:func:`local_hit_leaving_a_pull` trims such a hit to the last block boundary before N-1, so the
connector pulls that block's attention KV and the state at N-1, one transfer as for any other
request (``KVCacheManager.truncate_computed_blocks`` exists for this: "an external hit can supply
the final Mamba state"). :func:`apply` wraps vLLM's scheduler lookup in the decode worker's engine
(our connector module calls it); a vLLM without the divergent-hit lookup is left as it is.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["apply", "local_hit_leaving_a_pull"]

_METHOD = "_get_local_prefix_cache_hit"
_PATCHED = "_hybrid_pd_state_pull_hit"


def local_hit_leaving_a_pull(local_tokens: int, handed_off: int, block_size: int, diverged: bool) -> int:
    """The local hit to keep for a P/D request: ``local_tokens`` (whole blocks of attention KV), or where they cover all
    ``handed_off`` tokens (N-1) without the state there (``diverged``), the last block boundary before N-1."""
    if not diverged or local_tokens < handed_off or handed_off <= 0:
        return local_tokens
    return (handed_off - 1) // block_size * block_size


def apply() -> bool:
    """Wrap vLLM's scheduler lookup of the local prefix hit; False where this vLLM lacks the divergent-hit lookup (or it is wrapped).

    Capability, not version: the lookup, the manager's divergent-hit path and its truncation come together (vLLM 0.32).
    """
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    original = getattr(Scheduler, _METHOD, None)
    divergent = all(hasattr(KVCacheManager, name) for name in ("get_computed_blocks_for_connector", "truncate_computed_blocks"))
    if original is None or not divergent or getattr(original, _PATCHED, False):
        return False

    @functools.wraps(original)
    def lookup(self: Any, request: Any) -> tuple[Any, int, int, bool]:
        blocks, local, boundary, diverged = original(self, request)
        params = request.kv_transfer_params
        handed_off_of = getattr(self.connector, "remote_prefill_tokens", None)  # our connector's, not another's
        if not (diverged and params and params.get("do_remote_prefill") and handed_off_of is not None):
            return blocks, local, boundary, diverged
        handed_off = handed_off_of(request)
        keep = local_hit_leaving_a_pull(local, handed_off, self.block_size, diverged)
        if keep == local:
            return blocks, local, boundary, diverged
        return self.kv_cache_manager.truncate_computed_blocks(blocks, keep), keep, boundary, diverged

    setattr(lookup, _PATCHED, True)
    Scheduler._get_local_prefix_cache_hit = lookup
    return True
