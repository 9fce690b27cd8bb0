"""How the router relays decode answers: bytes as they come, only the usage event rewritten, several prompts merged.

These run :mod:`hybrid_pd.router.relay` alone, on byte chunks and parsed answers; the router
around it is tested against scripted workers in tests/test_router_protocol.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from hybrid_pd.router.relay import DecodeStream, StreamBroke, merge_answers, merge_usage, relay_one, relay_several

PREFILL_USAGE = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2}}
USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
MERGED = {**USAGE, "prompt_tokens_details": {"cached_tokens": 2}}
STREAM = {"model": "m", "prompt": ["x", "y"], "stream": True, "stream_options": {"include_usage": True}}


def _token(text: str, index: int = 0) -> bytes:
    # As vLLM writes it: compact, UTF-8 as is.
    return b"data: " + json.dumps({"choices": [{"index": index, "text": text}]}, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _usage_event(usage: dict) -> bytes:
    return b"data: " + json.dumps({"choices": [], "usage": usage}, separators=(",", ":")).encode() + b"\n\n"


def _events(relayed: bytes) -> list[str]:
    return [line[6:] for line in relayed.decode().split("\n") if line.startswith("data: ")]


async def _chunks(chunks: list[bytes], breaks: bool = False) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
    if breaks:
        raise httpx.ReadError("connection reset by peer")


def _stream(chunks: list[bytes], prefill_usage: dict | None = PREFILL_USAGE, breaks: bool = False, prompt: int = 0) -> DecodeStream:
    return DecodeStream(_chunks(chunks, breaks), "http://decode.test:2", prefill_usage, prompt)


async def _read(relayed: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in relayed]


async def test_events_cut_across_network_reads_are_relayed_whole_with_usage_merged():
    whole = _token(" a") + _token(" b") + _usage_event(USAGE) + b"data: [DONE]\n\n"
    cut = whole.index(b'"usage"') + 3  # the usage event arrives in two reads
    relayed = await _read(relay_one(_stream([whole[:5], whole[5:cut], whole[cut:]])))
    assert all(chunk.endswith(b"\n\n") for chunk in relayed), "a chunk went out with an event cut"
    events = _events(b"".join(relayed))
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == [" a", " b"]
    assert json.loads(events[2])["usage"] == MERGED
    assert events[3:] == ["[DONE]"], "vLLM's own [DONE] ends the answer, once"


async def test_every_event_of_a_read_keeps_its_bytes_but_the_usage_one():
    tokens = _token(" a") + b'data: {"choices":[{"index":0,"text":" b"}],"usage":null}\n\n'
    (relayed,) = await _read(relay_one(_stream([tokens + _usage_event(USAGE) + b"data: [DONE]\n\n"])))
    assert relayed.startswith(tokens), "token events were rewritten"
    assert json.loads(_events(relayed)[2])["usage"] == MERGED
    assert relayed.endswith(b"data: [DONE]\n\n")


async def test_without_a_prefill_usage_the_stream_goes_through_byte_for_byte():
    sent = _token(" a") + b'data: {"choices": [], "usage": {"prompt_tokens": 5}}\n\n' + b"data: [DONE]\n\n"
    assert b"".join(await _read(relay_one(_stream([sent[:7], sent[7:]], prefill_usage=None)))) == sent


async def test_a_stream_broken_mid_event_drops_the_partial_event_and_is_a_stream_broke():
    relayed: list[bytes] = []
    with pytest.raises(StreamBroke) as broke:
        async for chunk in relay_one(_stream([_token(" a") + b'data: {"choices":[{"ind'], breaks=True)):
            relayed.append(chunk)
    assert relayed == [_token(" a")]
    assert (broke.value.worker, broke.value.error) == ("http://decode.test:2", "ReadError")


async def test_a_streamed_prompt_list_is_merged_with_indexes_in_prompt_order_and_one_usage():
    streams = [_stream([_token(" a"), _usage_event(USAGE), b"data: [DONE]\n\n"], prompt=p) for p in range(2)]
    events = _events(b"".join(await _read(relay_several(streams, STREAM, "req-1"))))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"]) == [0, 1]
    tails = [c for c in chunks if "usage" in c]
    assert tails == [{"id": "req-1", "object": "text_completion", "choices": [], "usage": {**MERGED, "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}}]


async def test_merged_streams_are_cut_into_lines_at_line_ends_only_whatever_the_reads():
    line_separator = _token(" a\u2028b")  # str.splitlines would cut a line here
    streams = [_stream([_token(" x")[:9], _token(" x")[9:] + b"data: [DONE]\r\n\r\n"]), _stream([line_separator[:-1], line_separator[-1:]])]
    events = _events(b"".join(await _read(relay_several(streams, STREAM, "req-1"))))
    texts = {json.loads(e)["choices"][0]["index"]: json.loads(e)["choices"][0]["text"] for e in events[:-1]}
    assert texts == {0: " x", 1: " a\u2028b"}, "stream i is choice i"
    assert events[-1] == "[DONE]"


async def test_streamed_choices_of_two_prompts_count_each_prompt_once_in_the_usage():
    """n=2 over two prompts: four one-choice streams, prompts 0, 0, 1, 1 (vLLM counts a prompt once for all its choices)."""
    streams = [_stream([_token(" a"), _usage_event(USAGE), b"data: [DONE]\n\n"], prompt=p) for p in (0, 0, 1, 1)]
    events = _events(b"".join(await _read(relay_several(streams, STREAM, "req-1"))))
    chunks = [json.loads(e) for e in events[:-1]]
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"]) == [0, 1, 2, 3]
    usage = next(c["usage"] for c in chunks if "usage" in c)
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (10, 8, 18)


async def test_one_of_several_streams_breaking_is_a_stream_broke():
    streams = [_stream([_token(" a")]), _stream([_token(" b")], breaks=True)]
    with pytest.raises(StreamBroke, match="ReadError"):
        await _read(relay_several(streams, STREAM, "req-1"))


def test_whole_answers_are_merged_in_choice_order_with_each_prompt_counted_once():
    answers = [{"id": "a", "choices": [{"index": 0, "text": t}], "usage": dict(USAGE)} for t in ("p", "q", "r", "s")]
    merged = merge_answers(answers, [PREFILL_USAGE] * 4, prompts=[0, 0, 1, 1])
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "p"), (1, "q"), (2, "r"), (3, "s")]
    assert merged["id"] == "a" and merged["usage"] == {**MERGED, "prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18}


def test_one_whole_answer_gets_the_prefill_usage():
    answer = {"choices": [{"index": 0, "text": " decoded"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    assert merge_answers([answer], [PREFILL_USAGE], [0])["usage"] == {**MERGED, "completion_tokens": 3, "total_tokens": 8}


def test_usage_prompt_from_prefill_completion_from_decode():
    prefill = {"prompt_tokens": 23, "completion_tokens": 1, "total_tokens": 24, "prompt_tokens_details": {"cached_tokens": 16}}
    decode = {"prompt_tokens": 23, "completion_tokens": 8, "total_tokens": 31, "prompt_tokens_details": None}
    assert merge_usage(prefill, decode) == {
        "prompt_tokens": 23,
        "completion_tokens": 8,
        "total_tokens": 31,
        "prompt_tokens_details": {"cached_tokens": 16},
    }


def test_usage_without_one_side():
    decode = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert merge_usage(None, decode) == decode
    assert merge_usage({"prompt_tokens": 5}, None) is None
