"""Where a prompt is prefilled (hybrid_pd/router/decider.py)."""

from __future__ import annotations

from hybrid_pd.router.decider import Decision, decide


def test_where_a_prompt_is_prefilled():
    assert decide(99, False, ["p"], min_tokens=100, prefillers=()) == Decision((), "short_prompt")
    assert decide(100, False, [], min_tokens=100, prefillers=()) == Decision((), "no_prefill_worker")
    assert decide(100, False, ["p1", "p2"], 0, ()) == Decision(("p1", "p2"), "disaggregated")
    assert decide(100, True, ["f2"], 0, ()) == Decision((), "replica")  # a flex worker with no role serves it whole
    assert decide(100, True, ["f2", "f3", "p"], 0, {"f2", "f3"}) == Decision(("f2", "f3"), "planner")  # the planner's prefillers only
    assert decide(100, True, ["f2"], 0, {"f1"}) == Decision((), "replica")  # its prefillers busy or gone: whole
