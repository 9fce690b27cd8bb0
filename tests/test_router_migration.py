"""Mid-stream migration (hybrid_pd/router/migration.py): with scripted workers, then the pieces alone.

Two decode workers: the first breaks (or stalls) after two tokens, the second serves the
continuation. The client must see one stream, as if nothing happened.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from hybrid_pd.router.migration import Progress, continuation_body, is_migratable
from tests.router_support import KV, PREFILL, asgi_client, router_app

D1, D2 = "http://decode-one.test:3", "http://decode-two.test:4"
PROMPT_IDS = [11, 12, 13]


def _event(id_: str, text: str, ids: list[int], prompt_ids: list[int] | None = None, finish: str | None = None, offset: int | None = None) -> bytes:
    logprobs = None if offset is None else {"text_offset": [offset], "token_logprobs": [-0.5], "tokens": [text], "top_logprobs": [{text: -0.5}]}
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None,
              "prompt_token_ids": prompt_ids, "token_ids": ids}  # fmt: skip
    return b"data: " + json.dumps({"id": id_, "object": "text_completion",
                                   "created": 1, "model": "m", "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"  # fmt: skip


def _usage(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    return b"data: " + json.dumps({"id": "cmpl-second", "object": "text_completion", "created": 1, "model": "m", "choices": [], "usage": usage},
                                  separators=(",", ":")).encode() + b"\n\n"  # fmt: skip


class _Body(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], then: str | None) -> None:
        self.chunks, self.then = chunks, then

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.then == "break":
            raise httpx.ReadError("connection reset by peer")
        if self.then == "stall":
            await asyncio.sleep(3600)


class _TwoDecodeWorkers:
    """Prefill answers state; decode one sends two tokens then fails (``how``), decode two the rest."""

    def __init__(self, how: str = "break", logprobs: bool = False) -> None:
        self.how, self.logprobs = how, logprobs
        self.decode_bodies: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        if request.url.host == "prefill.test":
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": KV,
                                             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})  # fmt: skip
        url = f"http://{request.url.host}:{request.url.port}"
        self.decode_bodies.append((url, body))
        sse = {"content-type": "text/event-stream"}
        if url == D1:
            offsets = (0, 2) if self.logprobs else (None, None)
            first = [_event("cmpl-first", " a", [21], PROMPT_IDS, offset=offsets[0]), _event("cmpl-first", "bc", [22], offset=offsets[1])]
            return httpx.Response(200, headers=sse, stream=_Body([first[0], first[1][:20], first[1][20:]], self.how))
        offsets = (0, 2) if self.logprobs else (None, None)
        rest = [_event("cmpl-second", " d", [31], PROMPT_IDS + [21, 22], offset=offsets[0]),
                _event("cmpl-second", "e", [32], finish="length", offset=offsets[1]), _usage(5, 2), b"data: [DONE]\n\n"]  # fmt: skip
        return httpx.Response(200, headers=sse, stream=_Body(rest, None))


async def _stream(workers: _TwoDecodeWorkers, body: dict, **settings: object) -> tuple[list[str], httpx.Response]:
    app = router_app(workers, prefill=[PREFILL], decode=[D1, D2], decode_policy="round_robin", **settings)
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        await client.get("/health")  # both workers admitted
        app.state.router.registry.role("decode")[0].healthy = True
        app.state.router.registry.role("decode")[1].healthy = True
        r = await client.post("/v1/completions", json=body)
        events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
        metrics = (await client.get("/metrics")).text
    return events, r, metrics


BODY = {"model": "m", "prompt": "hi", "max_tokens": 4, "min_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("how", ["break", "stall"])
async def test_a_broken_or_stalled_stream_goes_on_on_another_decode_worker_as_one_stream(how):
    workers = _TwoDecodeWorkers(how)
    events, r, metrics = await _stream(workers, BODY, decode_stall_timeout_s=0.5)
    assert r.status_code == 200
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " abc de"
    assert {c["id"] for c in chunks} == {"cmpl-first"}
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["prompt_token_ids"] is None for c in chunks if c["choices"])
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4}  # the prompt once, every token
    (first_url, first), (second_url, second) = workers.decode_bodies
    assert (first_url, second_url) == (D1, D2)
    assert first["return_token_ids"] is True and "return_token_ids" not in BODY
    assert (second["prompt"], second["max_tokens"], second["min_tokens"], second["echo"]) == (PROMPT_IDS + [21, 22], 2, 1, False)
    assert 'hybrid_pd_migrations_total{outcome="ok"} 1.0' in metrics


async def test_the_client_gets_the_token_ids_it_asked_for_and_logprob_offsets_continue():
    workers = _TwoDecodeWorkers(logprobs=True)
    events, _, _ = await _stream(workers, {**BODY, "return_token_ids": True, "logprobs": 1})
    choices = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
    assert [c["token_ids"] for c in choices] == [[21], [22], [31], [32]]
    assert [c["prompt_token_ids"] for c in choices] == [PROMPT_IDS, None, None, None]
    assert [c["logprobs"]["text_offset"] for c in choices] == [[0], [2], [4], [6]]


async def test_without_migration_or_past_its_limit_a_break_ends_the_stream_with_an_error_event():
    workers = _TwoDecodeWorkers()
    events, _, metrics = await _stream(workers, BODY, migration_limit=0)
    assert events[-1] == "[DONE]" and "decode worker failed mid-stream" in events[-2]
    assert [url for url, _ in workers.decode_bodies] == [D1] and "return_token_ids" not in workers.decode_bodies[0][1]


async def test_a_stream_with_stop_strings_is_not_migrated_and_a_stall_still_ends_it():
    workers = _TwoDecodeWorkers("stall")
    events, _, _ = await _stream(workers, {**BODY, "stop": ["\n"]}, decode_stall_timeout_s=0.3)
    assert "decode worker failed mid-stream: StreamStalled" in events[-2] and events[-1] == "[DONE]"
    assert [url for url, _ in workers.decode_bodies] == [D1]


def test_which_requests_can_migrate():
    assert is_migratable("/v1/completions", {"stream": True, "prompt": "x"})
    assert not is_migratable("/v1/completions", {"stream": False})
    assert not is_migratable("/v1/chat/completions", {"stream": True})
    assert not is_migratable("/v1/completions", {"stream": True, "stop": ["Q:"]})
    assert not is_migratable("/v1/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}})


def test_a_continuation_before_any_event_is_the_request_itself():
    assert continuation_body({"prompt": "x", "max_tokens": 4}, Progress()) == {"prompt": "x", "max_tokens": 4, "return_token_ids": True}
