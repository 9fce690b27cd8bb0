"""Protocol edge cases of the router against scripted workers (no vLLM: see tests/e2e for that)."""

from __future__ import annotations

import json

import httpx
import pytest

from services.router.app import create_app
from services.router.settings import RouterSettings

PREFILL = "http://prefill.test:1"
DECODE = "http://decode.test:2"
KV = {"do_remote_prefill": True, "remote_block_ids": [[1], [2], [3]], "remote_engine_id": "e1", "remote_num_tokens": 4}


class Workers:
    """A scripted prefill and decode worker that records what they were sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, httpx.Headers]] = []
        self.prefill_response: httpx.Response | Exception = httpx.Response(
            200,
            json={
                "choices": [{"index": 0, "text": "PREFILL-TOKEN"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2}},
                "kv_transfer_params": KV,
            },
        )
        self.decode_stream: list[bytes] | None = None
        self.decode_breaks = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        worker = "prefill" if request.url.host == "prefill.test" else "decode"
        self.calls.append((worker, body, request.headers))
        if worker == "prefill":
            if isinstance(self.prefill_response, Exception):
                raise self.prefill_response
            return self.prefill_response
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Stream(self.decode_stream or [], self.decode_breaks))
        return httpx.Response(
            200,
            json={
                "choices": [{"index": 0, "text": " decoded"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            },
        )


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], breaks: bool) -> None:
        self.chunks, self.breaks = chunks, breaks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.breaks:
            raise httpx.ReadError("connection reset by peer")


@pytest.fixture
def workers() -> Workers:
    return Workers()


@pytest.fixture
async def client(workers: Workers):
    app = create_app(RouterSettings(prefill=[PREFILL], decode=[DECODE]), transport=httpx.MockTransport(workers))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c:
            yield c


async def test_both_legs_share_one_request_id_and_follow_the_pull_protocol(client, workers):
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8}, headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200
    (p_worker, p_body, p_headers), (d_worker, d_body, d_headers) = workers.calls
    assert (p_worker, d_worker) == ("prefill", "decode")
    assert p_headers["x-request-id"] == d_headers["x-request-id"] == "req-42"
    assert r.headers["x-request-id"] == "req-42"
    assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert d_body == {"model": "m", "prompt": "hi", "max_tokens": 8, "kv_transfer_params": KV}


async def test_request_id_is_generated_when_absent(client, workers):
    await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    ids = {headers["x-request-id"] for _, _, headers in workers.calls}
    assert len(ids) == 1 and len(ids.pop()) >= 16


async def test_answer_is_the_decode_answer_with_merged_usage(client):
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8})
    answer = r.json()
    assert answer["choices"][0]["text"] == " decoded"
    assert "PREFILL-TOKEN" not in r.text
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 2}}


async def test_stream_is_relayed_with_usage_rewritten(client, workers):
    workers.decode_stream = [
        b'data: {"choices":[{"index":0,"text":" a"}]}\n\n',
        b'data: {"choices":[{"index":0,"text":" b"}],"usage":null}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n',
        b"data: [DONE]\n\n",
    ]
    body = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == [" a", " b"]
    assert json.loads(events[2])["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    prefill_body = workers.calls[0][1]
    assert prefill_body["stream"] is False and "stream_options" not in prefill_body
    assert workers.calls[1][1]["stream"] is True


async def test_prefill_client_error_goes_back_unchanged_and_decode_is_not_called(client, workers):
    error = {"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError", "param": None, "code": 400}}
    workers.prefill_response = httpx.Response(400, json=error)
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": -1})
    assert r.status_code == 400 and r.json() == error
    assert [w for w, _, _ in workers.calls] == ["prefill"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
async def test_malformed_body_is_an_openai_400(client, workers, raw):
    r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert workers.calls == []


async def test_unreachable_prefill_worker_is_an_openai_502(client, workers):
    workers.prefill_response = httpx.ConnectError("connection refused")
    r = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 502
    assert "prefill worker failed" in r.json()["error"]["message"]


async def test_decode_failing_mid_stream_ends_with_an_error_event(client, workers):
    workers.decode_stream = [b'data: {"choices":[{"index":0,"text":" a"}]}\n\n']
    workers.decode_breaks = True
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == " a"
    assert "decode worker failed mid-stream" in json.loads(events[1])["error"]["message"]
    assert events[-1] == "[DONE]"


async def test_models_come_from_a_decode_worker(client, workers):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert workers.calls[0][0] == "decode"
