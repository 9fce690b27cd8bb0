"""Which decode engines' inboxes each prefill worker reaches (hybrid_pd/router/inbox_reach.py): whom the router asks,
when it asks again, where the prefill pushes. The router's legs with it: tests/test_router_early_decode.py; the worker's
answer: tests/test_handoff.py; real engines: tests/e2e/test_handoff_scheduler_hold.py."""

from __future__ import annotations

import logging

import httpx

from hybrid_pd.connector.compat import WorkerIdentity
from hybrid_pd.connector.contract import HANDOFF_REACH_QUERY
from hybrid_pd.router.inbox_reach import RECHECK_S, learn, push_url, to_ask
from hybrid_pd.router.registry import RoleName, Worker
from hybrid_pd.router.upstream import Upstream

INBOX = "tcp://10.0.0.9:6100"


def _worker(name: str, role: RoleName, inbox: str | None = None, healthy: bool | None = True) -> Worker:
    return Worker(url=f"http://{name}.test", role=role, identity=WorkerIdentity(role=role, handoff=True, handoff_inbox=inbox), id=name, healthy=healthy)


def test_each_available_prefilling_worker_is_asked_of_each_other_available_inbox_until_it_answered():
    p, f1, f2 = _worker("p", "prefill"), _worker("f1", "flex", "tcp://f1:1"), _worker("f2", "flex", "tcp://f2:2")
    d, gone, down = _worker("d", "decode", INBOX), _worker("gone", "decode", "tcp://gone:3", healthy=False), _worker("down", "prefill", healthy=False)
    asked = {(w.id, inbox) for w, inbox in to_ask([p, f1, f2, d, gone, down], now=0.0)}
    assert asked == {("p", INBOX), ("p", "tcp://f1:1"), ("p", "tcp://f2:2"), ("f1", INBOX), ("f1", "tcp://f2:2"), ("f2", INBOX), ("f2", "tcp://f1:1")}
    p.inboxes[INBOX] = (True, 0.0)
    f1.inboxes[INBOX] = (False, 0.0)
    later = {(w.id, inbox) for w, inbox in to_ask([p, f1, d], now=RECHECK_S - 1)}
    assert later == {("p", "tcp://f1:1")}  # a yes holds; a no waits
    assert ("f1", INBOX) in {(w.id, inbox) for w, inbox in to_ask([p, f1, d], now=RECHECK_S)}  # and is asked again


def test_the_prefill_pushes_to_the_inbox_only_where_it_said_it_reaches_it():
    p, d, plain = _worker("p", "prefill"), _worker("d", "decode", INBOX), _worker("plain", "decode")
    assert push_url(p, d) == ("server", d.url)  # not asked yet
    p.inboxes[INBOX] = (False, 0.0)
    assert push_url(p, d) == ("server", d.url)
    p.inboxes[INBOX] = (True, 0.0)
    assert push_url(p, d) == ("inbox", INBOX)
    assert push_url(p, plain) == ("server", plain.url)  # its early legs wait in its server or engine client


async def test_answers_are_kept_a_no_is_logged_once_and_a_worker_that_did_not_answer_is_asked_again(caplog):
    answers: dict[str, object] = {"p1": {"handoff": 1, "reaches": False}, "p2": httpx.ConnectError("refused"), "p3": {"handoff": 1}}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.params[HANDOFF_REACH_QUERY] == INBOX
        answer = answers[request.url.host.removesuffix(".test")]
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(200, json=answer)

    prefills, decode = [_worker(n, "prefill") for n in ("p1", "p2", "p3")], _worker("d", "decode", INBOX)
    async with Upstream(httpx.MockTransport(handler), httpx.Timeout(5)) as upstream:
        with caplog.at_level(logging.INFO, logger="hybrid_pd.router.inbox_reach"):
            await learn(upstream, [*prefills, decode], now=0.0)
            assert [p.inboxes for p in prefills] == [{INBOX: (False, 0.0)}, {}, {INBOX: (False, 0.0)}]  # another version: no
            assert caplog.text.count("does not reach") == 2
            await learn(upstream, [*prefills, decode], now=RECHECK_S)  # p2 asked again (and every no)
            assert caplog.text.count("does not reach") == 2
            answers["p1"] = {"handoff": 1, "reaches": True}
            await learn(upstream, [*prefills, decode], now=2 * RECHECK_S)
    assert prefills[0].inboxes == {INBOX: (True, 2 * RECHECK_S)}
    assert "now reaches" in caplog.text
    async with Upstream(httpx.MockTransport(handler), httpx.Timeout(5)) as upstream:
        await learn(upstream, prefills, now=3 * RECHECK_S)  # the decode worker left: what was said of its inbox goes
    assert [p.inboxes for p in prefills] == [{}, {}, {}]
