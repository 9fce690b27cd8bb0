"""The adaptive decision (hybrid_pd/router/decider.py): every branch, over hand-built loads."""

from __future__ import annotations

import pytest

from hybrid_pd.router.decider import Candidate, Decision, Slo, decide
from hybrid_pd.router.load import LiveLoad, LoadView

IDLE = LoadView(decodes=0, prefill_tokens=0, prefill_tokens_per_s=None, tpot_s=None)
SLO = Slo(ttft_s=0.5, tpot_s=0.020, split_above=0.5)


def _load(decodes=0, queued=0, rate=None, tpot=None) -> LoadView:
    return LoadView(decodes, queued, rate, tpot)


def test_short_prompts_and_no_candidates_stay_local():
    assert decide(99, IDLE, False, [Candidate("p", IDLE)], SLO, min_tokens=100) == Decision((), "short_prompt")
    assert decide(100, IDLE, False, [], SLO, min_tokens=100) == Decision((), "no_prefill_worker")


def test_a_decode_worker_takes_its_prompts_from_the_prefill_workers_that_are_in_time():
    slow = Candidate("slow", _load(queued=20_000, rate=10_000))  # 2 s of prompts ahead: past the 500 ms TTFT target
    fast = Candidate("fast", _load(queued=1_000, rate=10_000))  # 0.2 s
    new = Candidate("new", IDLE)  # never prefilled: no rate yet, counts as in time
    assert decide(1000, IDLE, False, [slow, fast, new], SLO, 0) == Decision(("fast", "new"), "disaggregated")
    assert decide(1000, IDLE, False, [slow], Slo(), 0) == Decision(("slow",), "disaggregated")  # no TTFT target: any


def test_a_decode_worker_prefills_locally_when_every_queue_breaks_ttft_and_it_has_tpot_headroom():
    late = [Candidate("a", _load(queued=20_000, rate=10_000)), Candidate("b", _load(queued=30_000, rate=10_000))]
    assert decide(1000, IDLE, False, late, SLO, 0) == Decision((), "prefill_queue")  # never prefilled here: no queue
    quick_here = _load(decodes=4, queued=0, rate=20_000, tpot=0.008)  # 50 ms here, 8 ms per token: headroom
    assert decide(1000, quick_here, False, late, SLO, 0) == Decision((), "prefill_queue")
    # Its own decodes near the TPOT target: a local prefill would break them; the soonest prefill worker, late or not.
    pressed = _load(decodes=40, queued=0, rate=20_000, tpot=0.015)
    assert decide(1000, pressed, False, late, SLO, 0) == Decision(("a",), "disaggregated")
    # A queue here longer than theirs: theirs.
    busy_here = _load(decodes=4, queued=60_000, rate=20_000, tpot=0.008)
    assert decide(1000, busy_here, False, late, SLO, 0) == Decision(("a",), "disaggregated")


def test_a_flexible_worker_prefills_for_itself_until_its_tpot_nears_the_target():
    other = Candidate("f2", _load(decodes=2))
    for tpot in (None, 0.005, 0.0099):  # unknown (nothing streams), or below half the 20 ms target
        assert decide(1000, _load(decodes=10, tpot=tpot), True, [other], SLO, 0) == Decision((), "decode_headroom")
    assert decide(1000, _load(decodes=10, tpot=0.010), True, [other], SLO, 0) == Decision(("f2",), "decode_pressure")
    # Only to a worker decoding fewer requests: elsewhere the same stall hits as many streams.
    assert decide(1000, _load(decodes=2, tpot=0.030), True, [other], SLO, 0) == Decision((), "decode_headroom")
    # No TPOT target: a flexible worker never splits (the same GPUs serve as replicas).
    assert decide(1000, _load(decodes=10, tpot=0.5), True, [other], Slo(ttft_s=0.5), 0) == Decision((), "decode_headroom")


def test_a_pressed_flexible_worker_still_respects_the_ttft_target():
    pressed = _load(decodes=10, queued=0, rate=20_000, tpot=0.015)
    late = Candidate("late", _load(decodes=1, queued=30_000, rate=10_000))
    ok = Candidate("ok", _load(decodes=3, queued=1_000, rate=10_000))
    assert decide(1000, pressed, True, [late, ok], SLO, 0) == Decision(("ok",), "decode_pressure")
    assert decide(1000, pressed, True, [late], SLO, 0) == Decision(("late",), "decode_pressure")  # pressed: no local stall


def test_the_live_load_behind_a_view():
    load = LiveLoad()
    assert load.view(now=0.0) == IDLE
    load.chunk_gap(0.010, now=100.0)
    assert load.view(now=100.5).tpot_s == pytest.approx(0.010)
    assert load.view(now=101.5).tpot_s is None  # a second without a chunk: it streams nothing now
    ahead = load.prefill_started(500)
    assert (ahead, load.prefill_started(250)) == (0, 500)
    load.prefill_done(250, ahead=500, seconds=0.075, ok=True, now=1.0)  # 750 tokens drained in 75 ms
    assert load.view(now=1.0).prefill_tokens_per_s == pytest.approx(10_000)
    assert load.view(now=1.0).prefill_wait_s(1000) == pytest.approx((500 + 1000) / 10_000)
