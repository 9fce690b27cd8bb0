"""The hand-off's pushes: their wire form, which legs wait for one, and the pushes that came before their leg looked."""

from __future__ import annotations

import json

import pytest

from hybrid_pd.connector.contract import HANDOFF_KEY_PARAM
from hybrid_pd.connector.vllm.pushes import Arrivals, held_key, parse_pushes
from tests.test_handoff import PUSHED
from tests.test_scheduler_hold import HELD, _Clock


def test_a_push_is_taken_once_with_when_it_came_and_one_nobody_takes_is_dropped_after_a_while():
    clock = _Clock()
    arrivals = Arrivals(unclaimed_s=300, clock=clock)
    arrivals.put([("old", PUSHED)])
    clock.now += 200
    arrivals.put([("new", {"remote_engine_id": "e2"})])
    assert "old" in arrivals and "gone" not in arrivals
    assert arrivals.take("new") == (300.0, {"remote_engine_id": "e2"})
    assert arrivals.take("new") is None  # taken once
    arrivals.put([("new", PUSHED)])
    clock.now += 101
    assert arrivals.take("old") is None  # 301 s unclaimed: its leg ended long ago
    assert arrivals.take("new") == (300.0, PUSHED)  # 101 s: kept


@pytest.mark.parametrize(
    ("params", "key"),
    [
        (HELD, "k1"),
        ({**HELD, "remote_engine_id": "e1"}, None),  # located: a leg that goes as it is
        ({"do_remote_decode": True, HANDOFF_KEY_PARAM: "k1"}, None),  # a prefill leg names a key too
        ({"do_remote_prefill": True}, None),
        (None, None),
    ],
)
def test_only_a_decode_leg_not_yet_located_is_held(params, key):
    assert held_key(params) == key


def test_a_push_batch_is_a_json_list_of_keys_and_parameters():
    assert parse_pushes(json.dumps([{"key": "a", "params": PUSHED}]).encode()) == [("a", PUSHED)]
    for body in (b"{}", b"[1]", b'[{"key": 1, "params": {}}]', b"nope"):
        assert parse_pushes(body) is None
