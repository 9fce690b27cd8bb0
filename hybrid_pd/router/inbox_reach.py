"""Which decode engines' inboxes each prefill worker reaches: the prefill's engine pushes straight to one only once known.

Why: a decode or flex worker whose scheduler holds early legs (``--early-leg-hold scheduler``,
:mod:`hybrid_pd.connector.vllm.scheduler_hold`) takes the prefill's pushes on a ZMQ inbox of its own (``tcp://`` its
side-channel host and ``--handoff-port``). ZMQ queues a push to an address it cannot connect to and reports nothing, so
where the prefill's host could not reach that port (a firewall between hosts, a side-channel host it cannot resolve)
every split leg waited out the decode worker's 120 s limit, then computed its prompt there. So the router asks each
prefill worker's server whether its host opens a connection to each such inbox (``GET`` ``HANDOFF_PATH?reach=``); until
it has said yes, the prefill leg names the decode worker's server, which relays the push to its engine: one HTTP hop
more, as pushes went before the scheduler hold, and nothing waits out a limit.

Decides where a prefill pushes (:func:`push_url`) and learns what it decides from (:func:`watch`); sends no push.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Literal, get_args
from urllib.parse import urlencode

import httpx

from hybrid_pd.common.logs import kv
from hybrid_pd.connector.contract import HANDOFF_PATH, HANDOFF_REACH_QUERY
from hybrid_pd.router.registry import DECODERS, PREFILLERS, Registry, Worker
from hybrid_pd.router.upstream import Upstream

__all__ = ["PUSH_PATHS", "RECHECK_S", "PushPath", "learn", "push_url", "to_ask", "watch"]

log = logging.getLogger("hybrid_pd.router.inbox_reach")

# Where a prefill's engine pushes: the decode worker's server, or its engine's inbox.
PushPath = Literal["server", "inbox"]
PUSH_PATHS: tuple[PushPath, ...] = get_args(PushPath)
# A "no" is asked again after this long (a port opened since); a "yes" holds while both stay registered (a worker that
# registers again is a new entry, asked afresh).
RECHECK_S = 30.0
# The prefill's server waits up to 2 s for the connection (hybrid_pd.connector.vllm.handoff.REACH_TIMEOUT_S).
_ASK_TIMEOUT_S = 5.0


def push_url(prefill: Worker, decode: Worker) -> tuple[PushPath, str]:
    """Where ``prefill``'s engine pushes an early leg's parameters for ``decode``: its engine's inbox where ``prefill`` said
    it reaches it, else its vLLM server (which holds the leg, or relays the push to its engine)."""
    inbox = decode.identity.handoff_inbox
    answer = prefill.inboxes.get(inbox) if inbox is not None else None
    return ("inbox", inbox) if inbox is not None and answer is not None and answer[0] else ("server", decode.url)


def to_ask(workers: Iterable[Worker], now: float) -> list[tuple[Worker, str]]:
    """The (prefill worker, inbox) questions due: each available prefilling worker about each other available decoding
    worker's inbox it has not answered for, or said no to :data:`RECHECK_S` ago."""
    workers = [w for w in workers if w.available]
    inboxes = [(w.id, w.identity.handoff_inbox) for w in workers if w.role in DECODERS and w.identity.handoff_inbox is not None]
    return [
        (prefill, inbox)
        for prefill in workers
        if prefill.role in PREFILLERS
        for decode_id, inbox in inboxes
        if decode_id != prefill.id and _due(prefill.inboxes.get(inbox), now)
    ]


def _due(answer: tuple[bool, float] | None, now: float) -> bool:
    return answer is None or (not answer[0] and now - answer[1] >= RECHECK_S)


async def _ask(upstream: Upstream, prefill: Worker, inbox: str) -> bool | None:
    """Whether ``prefill``'s host reaches ``inbox``, as its server says; None where the server did not answer (asked again
    next round). A server that answers without saying (another version) counts as no."""
    try:
        answer = await upstream.get(f"{prefill.url}{HANDOFF_PATH}?{urlencode({HANDOFF_REACH_QUERY: inbox})}", timeout=_ASK_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    try:
        return answer.status_code == 200 and answer.json().get("reaches") is True
    except (ValueError, AttributeError):
        return False


async def learn(upstream: Upstream, workers: Iterable[Worker], now: float | None = None) -> None:
    """Ask the questions due (:func:`to_ask`) at once and keep each answer on its prefill worker; forget the answers about
    inboxes no registered worker names any more (decode pods come and go, each with an address of its own)."""
    now = time.monotonic() if now is None else now
    workers = list(workers)
    named = {w.identity.handoff_inbox for w in workers}
    for worker in workers:
        for gone in worker.inboxes.keys() - named:
            del worker.inboxes[gone]
    questions = to_ask(workers, now)
    answers = await asyncio.gather(*(_ask(upstream, prefill, inbox) for prefill, inbox in questions))
    for (prefill, inbox), reaches in zip(questions, answers, strict=True):
        if reaches is None:
            continue
        before = prefill.inboxes.get(inbox)
        prefill.inboxes[inbox] = (reaches, now)
        if not reaches and before is None:
            log.warning("a prefill worker does not reach a decode engine's inbox: its pushes go through that decode worker's "
                        "server (a hop more); open the inbox's port to it %s", kv(prefill=prefill.url, inbox=inbox))  # fmt: skip
        elif reaches and before is not None and not before[0]:
            log.info("a prefill worker now reaches a decode engine's inbox %s", kv(prefill=prefill.url, inbox=inbox))


async def watch(registry: Registry, upstream: Upstream, interval_s: float) -> None:
    """Every ``interval_s``, until cancelled: the questions due over the registry's workers."""
    while True:
        await learn(upstream, registry.all())
        await asyncio.sleep(interval_s)
