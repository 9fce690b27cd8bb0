"""Where a prompt is prefilled (hybrid_pd/router/decider.py) and when flexible workers split by phase (hybrid_pd/router/phase_split.py)."""

from __future__ import annotations

import pytest

from hybrid_pd.router.decider import Decision, decide
from hybrid_pd.router.load import LiveLoad, LoadView
from hybrid_pd.router.phase_split import FlexLoad, PhaseSplit, SplitPolicy

POLICY = SplitPolicy(ttft_s=0.5, tpot_s=0.020, split_below=0.5, leave_above=0.8, quiet_below=0.2, window=4, hold_s=60)


def test_where_a_prompt_is_prefilled():
    assert decide(99, False, ["p"], min_tokens=100, prefiller=None) == Decision((), "short_prompt")
    assert decide(100, False, [], min_tokens=100, prefiller=None) == Decision((), "no_prefill_worker")
    assert decide(100, False, ["p1", "p2"], 0, None) == Decision(("p1", "p2"), "disaggregated")
    assert decide(100, True, ["f2"], 0, None) == Decision((), "replica")  # a flex worker serves it whole
    assert decide(100, True, ["f2"], 0, "f2") == Decision(("f2",), "phase_split")
    assert decide(100, True, ["f2"], 0, "f1") == Decision((), "replica")  # the prefiller itself, or gone: whole


def _flex(*tpots_decodes):
    return [FlexLoad(f"f{i}", LoadView(decodes, tpot)) for i, (tpot, decodes) in enumerate(tpots_decodes)]


def _observe(split: PhaseSplit, *ttfts: float, at: float = -1.0) -> None:
    """Streamed requests that arrived at ``at`` and got their first chunk ``ttft`` later."""
    for ttft in ttfts:
        split.observe_ttft(at, ttft)


def test_the_split_starts_when_ttft_breaks_its_target_while_tpot_has_room():
    split = PhaseSplit(POLICY)
    loads = _flex((0.009, 30), (0.008, 28))
    _observe(split, 0.7, 0.7, 0.7)
    assert split.update(0.0, loads) is None  # three TTFTs: not enough to decide on
    _observe(split, 0.7)
    assert split.update(1.0, loads) == "f1"  # the worker decoding fewest prefills for the other
    assert split.update(2.0, loads) == "f1"  # it holds until the split has TTFTs of its own


@pytest.mark.parametrize(
    ("ttft", "tpot", "policy"),
    [(0.4, 0.009, POLICY), (0.7, 0.011, POLICY), (0.7, None, POLICY), (0.7, 0.009, SplitPolicy(tpot_s=0.02, window=4))],
    ids=["ttft-within-target", "tpot-without-room", "nothing-streams", "no-ttft-target"],
)
def test_no_split_without_both_conditions(ttft, tpot, policy):
    split = PhaseSplit(policy)
    _observe(split, *[ttft] * 4)
    assert split.update(0.0, _flex((tpot, 30), (tpot, 30))) is None


def test_a_split_that_does_not_help_ends_and_holds_off():
    split = PhaseSplit(POLICY)
    _observe(split, *[0.7] * 4)
    assert split.update(0.0, _flex((0.009, 30), (0.009, 30))) == "f0"
    _observe(split, *[0.9] * 4, at=1.0)  # one prefiller does not keep up: TTFT worse
    assert split.update(5.0, _flex((None, 0), (0.010, 60))) is None
    _observe(split, *[0.7] * 4, at=6.0)
    assert split.update(30.0, _flex((0.009, 30), (0.009, 30))) is None  # held off for 60 s
    assert split.update(66.0, _flex((0.009, 30), (0.009, 30))) == "f0"


def test_a_split_ends_when_the_decoders_lose_their_tpot_room_or_it_is_quiet():
    split = PhaseSplit(POLICY)
    _observe(split, *[0.7] * 4)
    assert split.update(0.0, _flex((0.009, 30), (0.009, 30))) == "f0"
    _observe(split, *[0.3] * 4, at=0.5)
    assert split.update(1.0, _flex((None, 0), (0.015, 60))) == "f0"  # TPOT 15 ms, below 0.8 x 20: stays
    assert split.update(2.0, _flex((None, 0), (0.017, 60))) is None  # past it: back to replicas
    _observe(split, *[0.7] * 4, at=3.0)
    assert split.update(70.0, _flex((0.009, 30), (0.009, 30))) == "f0"
    _observe(split, *[0.05] * 4, at=70.5)  # 50 ms: below 0.2 x 500 ms, replicas answer sooner
    assert split.update(71.0, _flex((None, 0), (0.006, 1))) is None
    _observe(split, *[0.7] * 4, at=71.5)
    assert split.update(72.0, _flex((0.009, 30), (0.009, 30))) == "f0"  # a quiet end holds nothing off


def test_the_split_ends_when_its_prefiller_leaves_or_one_flex_worker_is_left():
    split = PhaseSplit(POLICY)
    _observe(split, *[0.7] * 4)
    assert split.update(0.0, _flex((0.009, 30), (0.009, 30), (0.009, 31))) == "f0"
    assert split.update(1.0, [FlexLoad("f1", LoadView(30, 0.009)), FlexLoad("f2", LoadView(31, 0.009))]) is None
    _observe(split, *[0.7] * 4, at=1.5)
    assert split.update(2.0, [FlexLoad("f1", LoadView(30, 0.009))]) is None


def test_only_requests_that_arrived_after_the_switch_judge_the_split():
    """On two H100s the replicas' queue, carried into the split's first window, ended a split that worked."""
    split = PhaseSplit(POLICY)
    _observe(split, *[0.9] * 4)
    assert split.update(10.0, _flex((0.009, 30), (0.009, 30))) == "f0"
    _observe(split, *[0.9] * 8, at=9.5)  # queued before the switch: their TTFT is the replicas'
    assert split.update(11.0, _flex((None, 0), (0.011, 60))) == "f0"
    _observe(split, *[0.3] * 4, at=10.5)  # the split's own: under target
    assert split.update(12.0, _flex((None, 0), (0.011, 60))) == "f0"


def test_the_live_load_behind_a_view():
    load = LiveLoad()
    assert load.view(now=0.0) == LoadView(0, None)
    load.chunk_gap(0.010, now=100.0)
    assert load.view(now=100.5).tpot_s == pytest.approx(0.010)
    assert load.view(now=101.5).tpot_s is None  # a second without a chunk: it streams nothing now
