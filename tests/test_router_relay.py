"""How the router relays decode streams: bytes as they come, only the usage event rewritten (scripted workers)."""

from __future__ import annotations

import json

import httpx

from tests.test_router_protocol import client, workers  # noqa: F401 - the scripted workers and the router in front of them

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
MERGED = {**USAGE, "prompt_tokens_details": {"cached_tokens": 2}}  # the scripted prefill's cached tokens
STREAM = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}


def _token(text: str, index: int = 0) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": index, "text": text}]}, separators=(",", ":")).encode() + b"\n\n"


def _usage_event(usage: dict) -> bytes:
    return b"data: " + json.dumps({"choices": [], "usage": usage}, separators=(",", ":")).encode() + b"\n\n"


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


async def test_events_cut_across_network_reads_are_relayed_whole_with_usage_merged(client, workers):
    whole = _token(" a") + _token(" b") + _usage_event(USAGE) + b"data: [DONE]\n\n"
    cut = whole.index(b'"usage"') + 3  # the usage event arrives in two reads
    workers.decode_stream = [whole[:5], whole[5:cut], whole[cut:]]
    r = await client.post("/v1/completions", json=STREAM)
    assert r.status_code == 200
    events = _events(r.text)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == [" a", " b"]
    assert json.loads(events[2])["usage"] == MERGED
    assert events[3:] == ["[DONE]"], "vLLM's own [DONE] ends the answer, once"


async def test_every_event_of_a_read_keeps_its_bytes_but_the_usage_one(client, workers):
    tokens = _token(" a") + b'data: {"choices":[{"index":0,"text":" b"}],"usage":null}\n\n'
    workers.decode_stream = [tokens + _usage_event(USAGE) + b"data: [DONE]\n\n"]
    r = await client.post("/v1/completions", json=STREAM)
    assert r.content.startswith(tokens), "token events were rewritten"
    assert json.loads(_events(r.text)[2])["usage"] == MERGED


async def test_without_a_prefill_usage_the_stream_goes_through_byte_for_byte(client, workers):
    workers.prefill_response = httpx.ConnectError("refused")  # local prefill: no prefill usage to merge
    sent = _token(" a") + b'data: {"choices": [], "usage": {"prompt_tokens": 5}}\n\n' + b"data: [DONE]\n\n"
    workers.decode_stream = [sent]
    r = await client.post("/v1/completions", json=STREAM)
    assert r.content == sent


async def test_a_stream_broken_mid_event_drops_the_partial_event_and_ends_with_an_error(client, workers):
    workers.decode_stream = [_token(" a") + b'data: {"choices":[{"ind']
    workers.decode_breaks = True
    r = await client.post("/v1/completions", json=STREAM)
    events = _events(r.text)
    assert json.loads(events[0])["choices"][0]["text"] == " a"
    assert "decode worker failed mid-stream: ReadError" in json.loads(events[1])["error"]["message"]
    assert events[2:] == ["[DONE]"]


async def test_a_streamed_prompt_list_is_merged_with_indexes_in_prompt_order_and_one_usage(client, workers):
    workers.decode_stream = [_token(" a"), _usage_event(USAGE), b"data: [DONE]\n\n"]
    r = await client.post("/v1/completions", json={**STREAM, "prompt": ["x", "y"], "n": 1})
    events = _events(r.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"]) == [0, 1]
    usages = [c["usage"] for c in chunks if "usage" in c]
    assert usages == [{**MERGED, "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}]
