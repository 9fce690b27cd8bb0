"""Early decode legs held in vLLM's scheduler (hybrid_pd/connector/vllm/scheduler_hold.py): the prefill's outbox pushes over
ZMQ to the decode engine's inbox, and the scheduler's look lets a leg go once its push came.

Real ZMQ sockets on this host here; inside real vLLM engines (the session stack's second decode worker) the e2e tests
(tests/e2e/test_handoff_scheduler_hold.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from hybrid_pd.common.processes import free_port
from hybrid_pd.connector.contract import HANDOFF_INBOX_ENV, HANDOFF_KEY_PARAM, HANDOFF_PATH
from hybrid_pd.connector.vllm.handoff import HandoffMiddleware, Outbox
from hybrid_pd.connector.vllm.pushes import held_key
from hybrid_pd.connector.vllm.scheduler_hold import WAIT, PushInbox, SchedulerHold
from tests.test_handoff import PUSHED, _App, _call, _early_leg, _engine_client

HELD = {"do_remote_prefill": True, HANDOFF_KEY_PARAM: "k1", "hybrid_pd_request_id": "r1"}


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def inbox():
    port = free_port()
    inbox = PushInbox(port, unclaimed_s=300)
    yield port, inbox
    inbox.close()


def _until(condition, seconds: float = 5.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (value := condition()) is not None:
            return value
        time.sleep(0.005)
    raise AssertionError("not within the time")


def _stepped_look(hold: SchedulerHold, request_id: str, key: str, params: dict):  # noqa: ANN202
    """The look of a scheduler step that follows the last one: None while vLLM keeps the leg waiting."""
    hold.step_ended()
    return None if (outcome := hold.look(request_id, key, params)) is WAIT else outcome


def test_the_outbox_pushes_to_the_decode_engines_inbox_and_the_leg_goes_on_with_the_pushed_parameters(inbox):
    port, box = inbox
    hold = SchedulerHold(box, wait_limit_s=120)
    assert hold.look("req-1", "k1", HELD) is WAIT  # the push has not come: vLLM keeps the leg waiting
    outbox = Outbox()  # kept: as the prefill's connector keeps it (a socket closed before it sent drops what it holds)
    outbox.push(f"tcp://127.0.0.1:{port}", "k1", PUSHED)
    outcome = _until(lambda: _stepped_look(hold, "req-1", "k1", HELD))
    params, pushed_at = outcome
    assert params == {**HELD, **PUSHED} and held_key(params) is None  # located now: vLLM's connector pulls
    assert pushed_at <= time.monotonic()
    assert hold.look("req-1", "k1", HELD) is WAIT  # taken once


def test_the_inbox_is_read_once_a_scheduler_step_whatever_the_number_of_legs_held(inbox):
    """vLLM's scheduler looks at every held leg in every step: a read of the socket per look cost each held leg 7-12 us of
    the engine's thread a step; a push that comes within a step is taken the next."""
    port, box = inbox
    hold = SchedulerHold(box, wait_limit_s=120)
    assert hold.look("req-1", "k1", HELD) is WAIT  # the step's read: nothing yet
    outbox = Outbox()
    outbox.push(f"tcp://127.0.0.1:{port}", "k1", PUSHED)
    time.sleep(0.2)  # the push is in the socket now
    assert hold.look("req-1", "k1", HELD) is WAIT  # the same step: not read again
    hold.step_ended()
    assert hold.look("req-1", "k1", HELD)[0] == {**HELD, **PUSHED}


def test_a_held_leg_ending_between_steps_leaves_the_next_step_its_own_read(inbox):
    port, box = inbox
    hold = SchedulerHold(box, wait_limit_s=120)
    assert hold.look("req-1", "k1", HELD) is WAIT
    hold.step_ended()
    assert hold.ended("req-2", "k2", {**HELD, HANDOFF_KEY_PARAM: "k2"}) is None  # vLLM ends a leg between steps: read now
    outbox = Outbox()
    outbox.push(f"tcp://127.0.0.1:{port}", "k1", PUSHED)
    time.sleep(0.2)
    assert hold.look("req-1", "k1", HELD)[0] == {**HELD, **PUSHED}  # the next step reads the inbox again


def test_a_push_that_came_before_its_leg_waits_for_it_and_one_for_another_leg_stays(inbox):
    port, box = inbox
    outbox = Outbox()
    outbox.push(f"tcp://127.0.0.1:{port}", "other", PUSHED)
    outbox.push(f"tcp://127.0.0.1:{port}", "k1", PUSHED)
    hold = SchedulerHold(box, wait_limit_s=120)
    assert _until(lambda: _stepped_look(hold, "req-1", "k1", HELD))[0] == {**HELD, **PUSHED}
    assert hold.look("req-2", "other", {**HELD, HANDOFF_KEY_PARAM: "other"})[0] == {**HELD, HANDOFF_KEY_PARAM: "other", **PUSHED}


def test_a_leg_whose_push_never_comes_goes_on_without_parameters_after_the_limit(inbox, caplog):
    _, box = inbox
    clock = _Clock()
    hold = SchedulerHold(box, wait_limit_s=120, clock=clock)
    assert hold.look("req-1", "k1", HELD) is WAIT
    clock.now += 119.9
    assert hold.look("req-1", "k1", HELD) is WAIT
    clock.now += 0.2
    with caplog.at_level(logging.WARNING, logger="vllm.hybrid_pd.scheduler_hold"):
        assert hold.look("req-1", "k1", HELD) == (None, None)  # the decode worker computes the prompt itself
    assert "no push came in 120 s" in caplog.text


def test_a_leg_that_ends_while_held_frees_the_prefills_blocks_only_once_its_push_came(inbox):
    """vLLM's NIXL connector fails on a leg whose prefill is not located (vLLM 0.32: KeyError 'remote_block_ids', the engine
    down): a held leg that ends (its client left, vLLM refused it) goes to it with the push's parameters or with none."""
    port, box = inbox
    hold = SchedulerHold(box, wait_limit_s=120)
    assert hold.look("req-1", "k1", HELD) is WAIT
    assert hold.ended("req-1", "k1", HELD) is None  # no push: nothing of the prefill's is known here (its lease frees it)
    outbox = Outbox()
    outbox.push(f"tcp://127.0.0.1:{port}", "k2", PUSHED)
    leg = {**HELD, HANDOFF_KEY_PARAM: "k2"}
    assert _until(lambda: hold.ended("req-2", "k2", leg)) == {**leg, **PUSHED}


def test_pushes_nobody_takes_are_dropped_after_a_while_and_a_malformed_one_at_once(caplog):
    import zmq

    clock, port = _Clock(), free_port()
    box = PushInbox(port, unclaimed_s=300, clock=clock)
    sender = zmq.Context.instance().socket(zmq.PUSH)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(f"tcp://127.0.0.1:{port}")
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.hybrid_pd.scheduler_hold"):
            sender.send(b"not json")
            sender.send(json.dumps([{"key": "old", "params": PUSHED}, {"key": "new", "params": PUSHED}]).encode())
            _until(lambda: box.take("new", read=True))
        assert "not a JSON list" in caplog.text
        clock.now += 301
        assert box.take("old") is None  # pruned: its leg ended long ago
    finally:
        sender.close()
        box.close()


async def test_a_scheduler_held_worker_names_its_engines_inbox_and_lets_early_legs_through(monkeypatch):
    monkeypatch.setenv(HANDOFF_INBOX_ENV, "tcp://10.0.0.7:5999")
    client, app = _engine_client(), _App()
    original = client._add_request
    middleware = HandoffMiddleware(app, engine_client=client)
    assert not middleware.in_engine_client and client._add_request is original  # vLLM's engine client holds nothing
    assert await _call(middleware, "GET", HANDOFF_PATH) == (200, b'{"handoff":1,"inbox":"tcp://10.0.0.7:5999"}')
    status, _ = await asyncio.wait_for(_call(middleware, "POST", "/v1/completions", _early_leg("k1"), early=True), 5)
    assert status == 200 and app.bodies == [_early_leg("k1")]  # straight to vLLM, as it came: its scheduler holds it
