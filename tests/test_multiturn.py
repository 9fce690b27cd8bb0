"""The multi-turn driver's arithmetic: the reusable ideal and the summary (no server: tests/e2e/test_prefix_caching.py runs it on real workers)."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from hybrid_pd.bench.client import RequestResult, complete
from hybrid_pd.bench.gpu.goodput import SERVERS, SYSTEMS
from hybrid_pd.bench.gpu.multiturn import worker_groups
from hybrid_pd.bench.multiturn import Conversations, Turn, ideal_reusable, request_id, summarize
from hybrid_pd.bench.timeline import request_group


def _turn(conversation: int, turn: int, prompt: list[int], ttft: float = 0.1, e2e: float = 1.0, sent: float = 0.0) -> Turn:
    return Turn(conversation, turn, tuple(prompt), RequestResult(sent_at=sent, e2e_s=e2e, ttft_s=ttft, output_tokens=10))


def test_the_ideal_is_each_prompts_longest_earlier_prefix_rounded_to_the_checkpoint():
    system = list(range(300))
    first = system + [1] * 40  # 340 tokens: nothing before it
    second = first + [2] * 60  # 400: shares all 340 -> 256
    other = system + [3] * 100  # another conversation: shares the 300-token system prompt -> 256
    whole = list(second)  # the very same prompt again: vLLM computes its last token -> 399 -> 384
    turns = [_turn(0, 0, first), _turn(0, 1, second), _turn(1, 0, other), _turn(2, 0, whole)]
    assert ideal_reusable(turns, 128) == 0 + 256 + 256 + 384
    assert ideal_reusable(turns, None) == 0


def test_summary_splits_first_and_later_turns_and_counts_goodput_per_gpu():
    turns = [_turn(0, 0, [1] * 20, ttft=0.4), _turn(0, 1, [1] * 30, ttft=0.05), _turn(1, 0, [2] * 20, ttft=0.6), _turn(1, 1, [2] * 30, ttft=0.07)]
    cache = {"prefill": {"hits": 30.0, "queries": 100.0}}
    summary = summarize(turns, wall_s=2.0, slos=[(500, 200)], gpus=2, cache=cache, ideal=40)
    assert summary["ttft_first_turn_ms"]["p50"] == pytest.approx(500.0) and summary["ttft_later_turns_ms"]["p50"] == pytest.approx(60.0)
    # TPOT (1.0 - TTFT) / 9 is under 200 ms for all four; TTFT 600 ms breaks the SLO once: 3 requests in 2 s on 2 GPUs.
    assert summary["goodput"]["500/200"] == {"req_s": 1.5, "req_s_per_gpu": 0.75}
    assert summary["cache"]["prefill"] == {"hits": 30.0, "queries": 100.0, "computed": 70.0, "hit_share_of_ideal": 0.75}


def test_request_ids_are_unique_per_run_and_group_the_timeline_by_turn():
    spec = Conversations(tag="pd-c8")
    ids = {request_id(spec, c, t, salt) for c in range(3) for t in range(4) for salt in (False, True)}
    ids.add(request_id(Conversations(tag="pd-c16"), 0, 0, False))
    assert len(ids) == 3 * 4 * 2 + 1  # no two requests of these runs share an id
    assert request_group(request_id(spec, 7, 2, False)) == "pd-c8-turn2"
    assert request_group(request_id(spec, 7, 0, True)) == "pd-c8-salted-turn0"


def test_conversations_draw_the_same_tokens_for_the_same_seed():
    spec = Conversations(seed=3, vocab=100)
    a, b = spec.ids(random.Random(1), 50), spec.ids(random.Random(1), 50)
    assert a == b and all(10 <= t < 90 for t in a)


def test_the_gpu_runner_reads_each_systems_cache_counters_by_the_role_its_router_gives():
    urls = {name: f"http://{name}" for name in SERVERS}
    assert worker_groups(SYSTEMS["pd"], urls) == {"prefill": ["http://flex0"], "decode": ["http://flex1"]}
    assert worker_groups(SYSTEMS["replicas"], urls) == {"decode": ["http://colocated0", "http://colocated1"]}
    assert worker_groups(SYSTEMS["adaptive"], urls) == {"flex": ["http://flex0", "http://flex1"]}


async def test_a_token_that_decodes_to_a_unicode_line_separator_does_not_cut_its_event():
    """vLLM leaves U+2028 and U+0085 unescaped in its JSON; httpx's aiter_lines cut there and the request counted as failed."""
    events = [{"choices": [{"index": 0, "text": text, "token_ids": [i]}]} for i, text in enumerate(["a", "\u2028", "b\u0085c"])]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode()))
    async with httpx.AsyncClient(transport=transport) as client:
        result = await complete(client, "http://server/v1/completions", {"stream": True})
    assert result.ok, result.error
    assert result.output_ids == (0, 1, 2) and result.output_tokens == 3
