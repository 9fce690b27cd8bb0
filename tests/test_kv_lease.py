"""The lease stamp and the decode side's verdict (hybrid_pd/connector/vllm/kv_lease.py), as pure functions."""

from __future__ import annotations

from hybrid_pd.connector.vllm.kv_lease import CLOCK_MARGIN_S, LEASE_EXPIRES_KEY, lease_expiry, pull_outlived_lease, stamp_lease

HANDOFF = {"do_remote_prefill": True, "remote_block_ids": [[2], [1]], "remote_engine_id": "e"}


def test_a_prefill_answer_that_hands_off_state_is_stamped_with_the_lease_end():
    stamped = stamp_lease(HANDOFF, lease_s=30, started_at=1000.0)
    assert stamped[LEASE_EXPIRES_KEY] == 1030.0
    assert LEASE_EXPIRES_KEY not in HANDOFF  # the caller's dict is left alone
    assert lease_expiry(stamped) == 1030.0


def test_answers_without_state_to_hand_off_are_not_stamped():
    assert stamp_lease(None, 30, 1000.0) is None
    assert stamp_lease({"do_remote_prefill": False}, 30, 1000.0) == {"do_remote_prefill": False}
    assert stamp_lease({"do_remote_prefill": True, "remote_block_ids": []}, 30, 1000.0) == {
        "do_remote_prefill": True,
        "remote_block_ids": [],
    }


def test_a_pull_completed_within_the_lease_passes_and_one_near_or_past_its_end_fails():
    assert not pull_outlived_lease(1030.0, completed_at=1010.0)
    assert not pull_outlived_lease(1030.0, completed_at=1030.0 - CLOCK_MARGIN_S - 0.01)
    assert pull_outlived_lease(1030.0, completed_at=1030.0 - CLOCK_MARGIN_S)
    assert pull_outlived_lease(1030.0, completed_at=1075.0)


def test_unstamped_or_malformed_parameters_cannot_be_judged_and_pass():
    assert lease_expiry(None) is None
    assert lease_expiry({}) is None
    assert lease_expiry({LEASE_EXPIRES_KEY: "soon"}) is None
    assert lease_expiry({LEASE_EXPIRES_KEY: True}) is None
    assert not pull_outlived_lease(None, completed_at=1e12)
