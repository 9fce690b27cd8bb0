"""The legs of a request: pair the workers, run the prefill leg, open the decode leg.

:func:`route` reads top to bottom: choose the decode worker -> choose a prefill worker
(:mod:`hybrid_pd.router.pairing`) -> prefill leg -> decode leg. Failures are handled where
they happen: a failed prefill leg falls back to a local prefill on the decode worker, a
prefill worker's refusal (4xx) is the client's answer, and a decode worker that fails
before its first byte is replaced once. Every leg in flight holds a registry
:class:`~hybrid_pd.router.registry.Lease`, released when the leg ends however it ends.

Where both workers take part (``--early-decode``, the default), the decode leg is sent with the
prefill leg and waits in the decode worker for the state (:func:`hybrid_pd.router.legs.early_decode_body`);
a prefill leg that gives no state closes it, and the request goes on as above.

With ``--timeline-dir`` each leg's hand-offs are recorded (:mod:`hybrid_pd.connector.trace.timeline`):
``prefill_sent``, ``prefill_answered``, ``decode_sent`` and a stream's ``decode_first_byte``,
named by the leg's request id (the one its ``X-Request-Id`` and ``kv_transfer_params`` carry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from hybrid_pd.common.logs import kv
from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.connector.contract import HANDOFF_KEY_HEADER
from hybrid_pd.connector.trace.timeline import TimelineWriter, writer_for
from hybrid_pd.router.inbox_reach import push_url
from hybrid_pd.router.legs import Handoff, LegEncoder, decode_body, early_decode_body, prefill_body
from hybrid_pd.router.migration import Opened, is_migratable, migrating_chunks, with_stall_timeout, with_token_ids
from hybrid_pd.router.policies import RequestInfo
from hybrid_pd.router.registry import Lease, Worker
from hybrid_pd.router.state import RouterState

__all__ = ["PrefillOutcome", "Routed", "decode_chunks", "route", "route_request"]

log = logging.getLogger("hybrid_pd.router")


@dataclass
class Routed:
    """An open answer for the client, and what relaying it needs.

    ``worker`` is whose answer it is: the decode worker's (``lease`` holds it in flight until
    :meth:`aclose`), or a prefill worker's refusal (``lease`` None: that leg is over), which
    goes back to the client as it came. ``sent_at``: when its leg was sent.
    """

    response: httpx.Response
    worker: Worker
    prefill_usage: dict | None
    lease: Lease | None
    sent_at: float
    prompt: int = 0  # which prompt of the client's request this answers (its choices share that prompt's usage)
    migratable: dict[str, Any] | None = None  # the client's request for this choice, when its stream can migrate

    async def aclose(self) -> None:
        """Stop counting the leg and close its answer (a decode worker whose connection closes aborts the request)."""
        if self.lease is not None:
            self.lease.release()
        await self.response.aclose()


@dataclass(frozen=True)
class PrefillOutcome:
    """How a prefill leg ended.

    ``state``: the worker holds the prompt's state; ``kv_transfer_params`` tell the decode
    worker where to pull it from, ``usage`` is what the prefill counted. ``refused``: the worker
    answered 4xx, ``response``, which the client gets as it came. ``failed``: no state, the
    decode worker prefills locally.
    """

    kind: Literal["state", "refused", "failed"]
    kv_transfer_params: dict | None = None
    usage: dict | None = None
    response: httpx.Response | None = None


_FAILED = PrefillOutcome("failed")

# Below this temperature vLLM samples greedily (its ``_SAMPLING_EPS``).
_GREEDY_BELOW = 1e-5


async def route_request(state: RouterState, path: str, body: dict[str, Any], request_id: str) -> list[Routed]:
    """The open answers for ``body``, one per choice the client asked for, in the order of its choices.

    A request for one choice of one prompt is one pair. Several prompts (completions) or
    ``n > 1`` run as one pair per prompt and choice, each asking for one choice: vLLM gives
    the decode worker's pulls of one prefill's state to every choice of a request, while that
    prefill frees the state at the first pull's notice (several choices read freed blocks,
    and the prefill held state for the choices it sampled itself until its lease ran out).
    Choice ``j`` of a seeded request gets ``seed + j``, as vLLM seeds the choices of one
    request, so the answers are the colocated ones.
    """
    bodies = _one_choice_each(path, body, state.settings.max_concurrency)
    if bodies is None:
        return [await _route_choice(state, path, body, request_id)]
    tasks = [asyncio.ensure_future(_route_choice(state, path, b, f"{request_id}-{i}")) for i, (_, b) in enumerate(bodies)]
    try:
        routed = list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                await task.result().aclose()
        raise
    for answer, (prompt, _) in zip(routed, bodies, strict=True):
        answer.prompt = prompt
    return routed


async def _route_choice(state: RouterState, path: str, body: dict[str, Any], request_id: str) -> Routed:
    """One choice's pair; a stream that can migrate asks for its token ids and remembers the client's request."""
    if state.settings.migration_limit == 0 or not is_migratable(path, body):
        return await route(state, path, body, request_id)
    routed = await route(state, path, with_token_ids(body), request_id)
    routed.migratable = body
    return routed


def decode_chunks(state: RouterState, path: str, routed: Routed, request_id: str) -> AsyncIterator[bytes]:
    """The bytes of a streamed decode answer: carried to another worker when it breaks or stalls, if it can migrate.

    One that cannot is still cut off when it stalls, so a frozen worker ends the client's
    stream with an error event instead of holding it open.
    """
    settings, worker = state.settings, routed.worker
    trace = _timeline(state)
    if routed.migratable is None:
        chunks = with_stall_timeout(routed.response.aiter_bytes(), settings.decode_stall_timeout_s)
        return chunks if trace is None else _first_byte_noted(chunks, trace, request_id)

    async def reroute(body: dict[str, Any], avoid: set[str]) -> Opened:
        following = await route(state, path, body, f"{request_id}-migrated", avoid)
        if following.response.status_code != 200:
            log.warning("migration refused %s", kv(worker=following.worker.url, status=following.response.status_code))
            await following.aclose()
            raise OpenAIError(502, "the continuation was refused")
        return Opened(following.response.aiter_bytes(), following.worker.id, following.worker.url, following.aclose)

    first = Opened(routed.response.aiter_bytes(), worker.id, worker.url, routed.aclose)
    counted = lambda outcome: state.metrics.migrations.labels(outcome).inc()  # noqa: E731
    chunks = migrating_chunks(first, routed.migratable, reroute, settings.migration_limit, settings.decode_stall_timeout_s, counted)
    return chunks if trace is None else _first_byte_noted(chunks, trace, request_id)


async def _first_byte_noted(chunks: AsyncIterator[bytes], trace: TimelineWriter, request_id: str) -> AsyncIterator[bytes]:
    """``chunks`` as they come; the first one's arrival is the timeline's ``decode_first_byte`` of ``request_id``."""
    first = True
    async for chunk in chunks:
        if first:
            trace.event("decode_first_byte", rid=request_id)
            first = False
        yield chunk


def _timeline(state: RouterState) -> TimelineWriter | None:
    """The router's timeline writer, None when ``--timeline-dir`` is off."""
    directory = state.settings.timeline_dir
    return writer_for(directory, "router") if directory else None


def _one_choice_each(path: str, body: dict[str, Any], limit: int) -> list[tuple[int, dict[str, Any]]] | None:
    """``body`` as one request per prompt and choice, each with its prompt's index; None when it asks for one choice.

    A malformed ``n`` or prompt list is not split: vLLM answers it with its own 400.
    """
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    prompts = body["prompt"] if path == "/v1/completions" and _is_prompt_list(body) else None
    if n == 1 and prompts is None:
        return None
    temperature = body.get("temperature")
    if n > 1 and isinstance(temperature, (int, float)) and temperature < _GREEDY_BELOW:
        # vLLM's own rule (SamplingParams), which one-choice requests would no longer meet; its words.
        raise OpenAIError(400, f"n must be 1 when using greedy sampling, got {n}.", param="n")
    count = n * (len(prompts) if prompts is not None else 1)
    if count > limit:
        raise OpenAIError(400, f"{count} choices (prompts x n) exceed the router's {limit} requests in flight", param="n")
    seed = body.get("seed")
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    out = []
    for i, prompt in enumerate(prompts if prompts is not None else [None]):
        for j in range(n):
            one = {**body, "n": 1} if prompt is None else {**body, "prompt": prompt, "n": 1}
            if seeded:
                one["seed"] = seed + j
            out.append((i, one))
    return out


def _is_prompt_list(body: dict[str, Any]) -> bool:
    """A completions request with several prompts: all strings or all token-id lists.

    Anything else (a mixed list, say) goes to vLLM as it came, so the client gets vLLM's own 400.
    """
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return False
    return all(isinstance(p, str) for p in prompt) or all(
        isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt
    )


async def route(state: RouterState, path: str, body: dict[str, Any], request_id: str, avoid: Collection[str] = ()) -> Routed:
    """Choose the pair, run the prefill leg and open the decode leg (retried once before its first byte).

    ``avoid``: ids of decode workers not to use (a migrating stream's failed ones).
    """
    started = time.perf_counter()
    pairing, metrics = state.pairing, state.metrics
    info = RequestInfo.from_body(body, state.settings.prefix_affinity_chars)
    encoder = LegEncoder(body)
    trace = _timeline(state)
    headers = {"X-Request-Id": request_id}
    tried: set[str] = set(avoid)
    prefill_s = 0.0
    for attempt in range(2):
        if not pairing.decode_available():
            await state.registry.check_all(state.upstream)  # evicted workers may be back: look now, not at the next round
        decode = pairing.decode(info, tried)
        # Counted on the decode worker from now, not from when its leg is sent: requests that arrive
        # while this one's prefill runs must see it there, or they all pick the same decode worker.
        lease = state.registry.lease(decode, info.est_tokens)
        choice = pairing.prefill(decode, info)
        kv_params, prefill_usage, reason = None, None, choice.reason
        early: asyncio.Future[Routed | None] | None = None
        if choice.worker is not None:
            handoff = _handoff(state, choice.worker, decode)
            if handoff is not None:  # the decode leg goes now and waits at the decode worker for the prefill's push
                if trace is not None:
                    trace.event("decode_sent", rid=request_id)
                leg_body = encoder.encode(early_decode_body(body, handoff, request_id))
                early_headers = {**headers, HANDOFF_KEY_HEADER: handoff.key}
                early = asyncio.ensure_future(_decode_leg(state, decode, lease, path, leg_body, early_headers, None, attempt))
            leg_body = encoder.encode(prefill_body(body, request_id, handoff))
            if trace is not None:
                trace.event("prefill_sent", rid=request_id)
            leg_started = time.perf_counter()
            try:
                outcome = await _prefill_leg(state, choice.worker, path, leg_body, headers, info)
            except BaseException:  # cancelled (the client left) during the prefill leg
                if early is not None:
                    await _close_early(early)
                lease.release()
                raise
            prefill_s += time.perf_counter() - leg_started
            if trace is not None:
                trace.event("prefill_answered", rid=request_id)
            if early is not None and (outcome.kind != "state" or outcome.kv_transfer_params is None):
                await _close_early(early)  # no state for it: it never reached vLLM; the usual legs follow
                lease.release()
                early, lease = None, state.registry.lease(decode, info.est_tokens)
            if outcome.kind == "refused":
                lease.release()
                return Routed(outcome.response, choice.worker, None, None, time.perf_counter())
            kv_params, prefill_usage = outcome.kv_transfer_params, outcome.usage
            if kv_params is None:  # failed, or answered without the state's whereabouts: the decode worker prefills
                reason = "prefill_failed"
        (metrics.disaggregated if kv_params is not None else metrics.fallbacks).labels(reason).inc()
        metrics.overhead.observe(max(0.0, time.perf_counter() - started - prefill_s))
        if early is not None:
            routed = await early
            if routed is not None:
                routed.prefill_usage = prefill_usage
        else:
            leg_body = encoder.encode(decode_body(body, kv_params, request_id))
            if trace is not None:
                trace.event("decode_sent", rid=request_id)
            routed = await _decode_leg(state, decode, lease, path, leg_body, headers, prefill_usage, attempt)
        if routed is not None:
            if log.isEnabledFor(logging.INFO):  # one line per request: skip formatting it when INFO is off
                log.info(
                    "routed %s",
                    kv(path=path, decode=decode.url, status=routed.response.status_code, transfer=kv_params is not None, reason=reason),
                )
            return routed
        tried.add(decode.id)
        if attempt == 0 and pairing.decode_available(tried):
            metrics.retries.inc()
            continue
        break
    raise OpenAIError(502, "decode worker failed before answering")


def _handoff(state: RouterState, prefill: Worker, decode: Worker) -> Handoff | None:
    """An early decode leg's hand-off, where the router sends them and both workers take part; else None."""
    if state.settings.early_decode and prefill.identity.handoff and decode.identity.handoff:
        path, url = push_url(prefill, decode)
        state.metrics.early_legs.labels(path).inc()
        return Handoff(uuid.uuid4().hex, url)
    return None


async def _close_early(early: asyncio.Future[Routed | None]) -> None:
    """End an early decode leg whose prefill gave no state: cancelled, or its open answer closed (its lease: the caller's to release, once more)."""
    early.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        routed = await early
        if routed is not None:
            await routed.aclose()


async def _prefill_leg(state: RouterState, prefill: Worker, path: str, leg_body: bytes, headers: dict, info: RequestInfo) -> PrefillOutcome:
    """Send the prefill leg ``leg_body`` to ``prefill``; how it ended."""
    started = time.perf_counter()
    try:
        with state.registry.lease(prefill, info.est_tokens, "prefill"):
            response = await state.upstream.request("POST", prefill.url + path, json_body=leg_body, headers=headers)
    except httpx.HTTPError as exc:
        log.warning("prefill leg failed, local prefill %s", kv(worker=prefill.url, error=type(exc).__name__))
        state.registry.record_health(prefill, ok=False)
        return _FAILED
    finally:
        state.metrics.prefill_leg.observe(time.perf_counter() - started)
    if 400 <= response.status_code < 500:
        log.info("prefill refused %s", kv(worker=prefill.url, status=response.status_code))
        return PrefillOutcome("refused", response=response)
    if response.status_code != 200:
        log.warning("prefill leg failed, local prefill %s", kv(worker=prefill.url, status=response.status_code))
        return _FAILED
    answer = response.json()
    return PrefillOutcome("state", answer.get("kv_transfer_params"), answer.get("usage"))


async def _decode_leg(
    state: RouterState, decode: Worker, lease: Lease, path: str, leg_body: bytes, headers: dict, prefill_usage: dict | None, attempt: int
) -> Routed | None:
    """Send the decode leg and return its open answer; None when ``decode`` failed before answering (a 5xx or no answer).

    ``lease`` counts the request on ``decode`` since it was chosen; the answer holds it, a failure releases it.
    """
    sent_at = time.perf_counter()
    try:
        response = await state.upstream.request("POST", decode.url + path, json_body=leg_body, headers=headers, stream=True)
    except httpx.HTTPError as exc:
        lease.release()
        log.warning("decode leg failed %s", kv(worker=decode.url, error=type(exc).__name__, attempt=attempt))
    except BaseException:
        lease.release()  # cancelled (the client left): the leg is not in flight any more
        raise
    else:
        if response.status_code < 500:
            return Routed(response, decode, prefill_usage, lease, sent_at)
        lease.release()
        await response.aclose()
        log.warning("decode leg failed %s", kv(worker=decode.url, status=response.status_code, attempt=attempt))
    state.registry.record_health(decode, ok=False)
    return None
