"""Pulls awaited in the step that posted them (hybrid_pd/connector/vllm/pull_await.py): what is awaited and for how long."""

from __future__ import annotations

import itertools

from hybrid_pd.connector.vllm.pull_await import await_transfers, awaits, posted_since


def test_posted_since_names_only_the_handles_this_step_added():
    before = {"a": [1, 2], "b": [3]}
    after = {"a": [1, 2], "b": [3, 4], "c": [5, 6]}
    assert posted_since(before, after) == [4, 5, 6]
    assert posted_since(after, {"a": [1]}) == []
    assert posted_since({}, {}) == []


class _Nixl:
    """NIXL's check_xfer_state for handles that finish after a number of checks (None: never)."""

    def __init__(self, checks_to_done: dict[int, int | None], fail: frozenset[int] = frozenset()) -> None:
        self.left = dict(checks_to_done)
        self.fail = fail
        self.calls: list[int] = []

    def state_of(self, handle: int) -> str:
        self.calls.append(handle)
        if handle in self.fail:
            raise RuntimeError("NIXL_ERR_BACKEND")
        left = self.left[handle]
        if left is None:
            return "PROC"
        if left > 0:
            self.left[handle] = left - 1
            return "PROC"
        return "DONE"


def _clock(step_s: float):
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


def test_waits_until_every_posted_read_is_done():
    nixl = _Nixl({7: 0, 8: 3})
    assert await_transfers([7, 8], nixl.state_of, budget_s=1.0, clock=_clock(1e-6)) is True
    assert nixl.left == {7: 0, 8: 0}
    assert nixl.calls.count(7) == 1  # a done read is not asked again


def test_gives_up_at_the_budget_and_leaves_the_read_to_vllm():
    nixl = _Nixl({7: None})
    assert await_transfers([7], nixl.state_of, budget_s=1e-3, clock=_clock(1e-4)) is False
    assert 5 <= len(nixl.calls) <= 12  # bounded by the budget, not by the read


def test_a_read_whose_state_cannot_be_read_is_not_waited_for():
    nixl = _Nixl({7: None, 8: 1}, fail=frozenset({7}))
    assert await_transfers([7, 8], nixl.state_of, budget_s=1.0, clock=_clock(1e-6)) is True
    assert nixl.calls.count(7) == 1


def test_nothing_posted_returns_at_once():
    nixl = _Nixl({})
    assert await_transfers([], nixl.state_of, budget_s=1.0) is True
    assert nixl.calls == []


def test_only_a_step_that_runs_no_model_waits_and_only_with_a_budget():
    """A step that runs the model is one every running request waits for: waiting there cost TPOT at real scale (docs/connector.md)."""
    assert awaits(2e-3, scheduled_tokens=0) is True
    assert awaits(2e-3, scheduled_tokens=1) is False
    assert awaits(2e-3, scheduled_tokens=64) is False
    assert awaits(0.0, scheduled_tokens=0) is False
