"""The sizing simulator against cases computed by hand (profile: tests/sizing_support.py)."""

from __future__ import annotations

import dataclasses

import pytest

import hybrid_pd.sizing.simulate as simulate_module
from hybrid_pd.connector.plan import plan_transfer
from hybrid_pd.sizing.engine import Engine, Job
from hybrid_pd.sizing.layouts import Layout, layouts
from hybrid_pd.sizing.simulate import SLO, check_fits, predict, simulate, size, summarize
from hybrid_pd.sizing.workload import Lengths, Workload
from tests.sizing_support import PAGE, SHAPE, tiny_profile

REPLICAS, SPLIT = Layout("replicas", 0, 2), Layout("pd", 1, 1)


def fixed(prompt: int, output: int, n: int, concurrency: int | None = None, rate: float | None = None, seed: int = 0) -> Workload:
    return Workload(Lengths(prompt, prompt), Lengths(output, output), n, concurrency, rate, seed)


def test_a_lone_request_takes_its_prompt_latency_and_step_then_one_decode_step_a_token():
    (o,) = simulate(tiny_profile(), REPLICAS, fixed(100, 10, 1, concurrency=1))
    assert o.ttft_ms == pytest.approx(11.0 + 5.0 + 0.01 * 100)  # latency table at 100 tokens; a step of 100 prompt tokens
    # 9 decode steps of one row over 100, 101, ... 108 tokens of context
    assert o.tpot_ms == pytest.approx(5.0 + 0.5 + 0.001 * (100 + 108) / 2)


def test_each_prompt_in_a_step_adds_its_own_cost_besides_its_tokens():
    """Two prompts that arrive together share one step, which costs ``prefill_per_prompt_ms`` twice (four-H100 waves)."""
    profile = tiny_profile().model_copy(update={"prefill_per_prompt_ms": 7.0})
    (o,) = simulate(profile, REPLICAS, fixed(100, 2, 1, concurrency=1))
    assert o.ttft_ms == pytest.approx(11.0 + 5.0 + 0.01 * 100 + 7.0)
    both = simulate(profile, Layout("replicas", 0, 1), fixed(100, 2, 2, concurrency=2))
    assert [x.ttft_ms for x in both] == pytest.approx([11.0 + 5.0 + 0.01 * 200 + 2 * 7.0] * 2)


def test_a_lone_split_request_adds_the_hand_off_the_transfer_of_plans_bytes_and_the_decode_workers_step():
    (o,) = simulate(tiny_profile(), SPLIT, fixed(100, 10, 1, concurrency=1))
    moved = plan_transfer(SHAPE, 100, block_size=16).total_bytes
    prefill = 11.0 + 5.0 + 0.01 * 99  # the prefill worker stops at token N-1
    assert o.ttft_ms == pytest.approx(prefill + 3.0 + (1.0 + moved / 1e6) + (5.0 + 0.01 * 1))
    assert o.tpot_ms == pytest.approx(5.0 + 0.5 + 0.001 * (100 + 108) / 2)


def test_decode_bound_throughput_stays_under_the_step_bound_and_reaches_it():
    """max_num_seqs S caps the batch: a request needs m token steps, each step serves <= S, so req/ms <= 1 / (m x base / S + (m - 1) x per_seq)."""
    profile = tiny_profile(max_num_seqs=4, prefill_per_token_ms=0.0, prompt_latency_ms=[(0, 0.0)],
                           decode={"base_ms": 5.0, "per_seq_ms": 0.5, "per_context_token_ms": 0.0})  # fmt: skip
    m = 50
    bound = 1 / (m * 5.0 / 4 + (m - 1) * 0.5) * 1e3
    got = predict(profile, Layout("replicas", 0, 1), fixed(1, m, 200, concurrency=16), SLO(1e9, 1e9)).throughput_rps
    assert 0.97 * bound <= got <= bound * (1 + 1e-9)


def test_prefill_bound_throughput_stays_under_the_budget_bound_of_the_one_prefill_worker():
    """Full steps of B prompt tokens take base + p x B: at most B / (base + p x B) / (N - 1) prefill legs a ms."""
    profile = tiny_profile(max_num_batched_tokens=4000)
    bound = 4000 / (5.0 + 0.01 * 4000) / 1000 * 1e3
    got = predict(profile, SPLIT, fixed(1001, 2, 200, concurrency=64), SLO(1e9, 1e9)).throughput_rps
    assert 0.9 * bound <= got <= bound


def test_a_request_at_the_slo_counts_and_one_just_over_does_not():
    workload = fixed(100, 10, 1, concurrency=1)
    outcomes = simulate(tiny_profile(), REPLICAS, workload)
    (o,) = outcomes
    at = summarize(REPLICAS, outcomes, SLO(o.ttft_ms, o.tpot_ms))
    assert at.slo_met == 1 and at.goodput_rps == at.throughput_rps
    for slo in (SLO(o.ttft_ms - 1e-6, o.tpot_ms), SLO(o.ttft_ms, o.tpot_ms - 1e-6)):
        assert summarize(REPLICAS, outcomes, slo).goodput_rps == 0
    assert at.goodput_per_gpu == at.goodput_rps / 2


def test_the_router_counts_a_request_on_its_decode_worker_from_arrival_so_a_burst_spreads():
    """A request counts on the decode worker picked at its arrival, prefill leg included (the router's lease):
    two requests at once decode on two workers, each alone in its batch."""
    two = simulate(tiny_profile(), Layout("pd", 1, 2), fixed(100, 10, 2, concurrency=2))
    alone = simulate(tiny_profile(), Layout("pd", 1, 2), fixed(100, 10, 1, concurrency=1))
    assert all(o.tpot_ms == pytest.approx(alone[0].tpot_ms) for o in two)


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    workload = Workload(Lengths(50, 150), Lengths(5, 20), 60, rate=0.05, seed=3)
    runs = [simulate(tiny_profile(), Layout("pd", 1, 2), w) for w in (workload, workload, dataclasses.replace(workload, seed=4))]
    assert runs[0] == runs[1] != runs[2]


class _OneStep(Engine):
    """The engine without runs: each pure decode step planned on its own."""

    def plan(self, now_ms: float):
        step, pulls = super().plan(now_ms)
        if step is not None and step.count > 1:
            self.step = step = dataclasses.replace(step, count=1)
        return step, pulls


@pytest.mark.parametrize(
    ("layout", "workload", "cache_pages"),
    [
        (REPLICAS, Workload(Lengths(20, 300), Lengths(5, 80), 80, rate=0.1, seed=1), 4096),
        (Layout("pd", 1, 2), Workload(Lengths(20, 300), Lengths(5, 80), 80, concurrency=12, seed=2), 4096),
        (Layout("pd", 2, 1), Workload(Lengths(20, 300), Lengths(5, 80), 80, concurrency=12, seed=3), 60),  # memory-bound: preemption
    ],
)
def test_runs_of_decode_steps_give_the_same_times_as_one_step_at_a_time(monkeypatch, layout, workload, cache_pages):
    profile = tiny_profile(cache_bytes=cache_pages * PAGE)
    runs = simulate(profile, layout, workload)
    monkeypatch.setattr(simulate_module, "Engine", _OneStep)
    steps = simulate(profile, layout, workload)
    assert len(runs) == len(steps) == workload.num_prompts
    for a, b in zip(runs, steps, strict=True):
        assert a.request == b.request
        assert (a.first_ms, a.done_ms) == pytest.approx((b.first_ms, b.done_ms), abs=1e-6)


def test_out_of_memory_the_last_started_sequence_is_preempted_and_computed_again():
    engine = Engine(tiny_profile(cache_bytes=8 * PAGE))  # two sequences of 2 state pages + 2 blocks
    first, second = Job(0, 32, 0, 10), Job(1, 32, 0, 10)
    engine.submit(first)
    engine.submit(second)
    step, _ = engine.plan(0.0)
    assert [n for _, n in step.tokens] == [32, 32] and engine.free_bytes == 0
    engine.finish()  # both sampled their first token after 32 computed tokens; the next needs a third block each
    step, _ = engine.plan(step.end_ms)
    assert [job for job, _ in step.tokens] == [first]
    assert engine.waiting == [second] and (second.prompt_left, second.context, second.memory) == (33, 0, 0)


def test_on_a_busy_decode_worker_a_pull_is_posted_a_step_late_and_its_row_runs_two_steps_after_it_is_done():
    """vLLM's asynchronous scheduling, which decode workers keep: the step that admits a decode leg was planned while the
    one before it ran, so it posts the pull as the step after it starts; a pull done while a step runs is reported by
    that step, when the next is planned already. Steps of 5 ms; before this, the row ran at 10 ms, its token at 15."""
    engine = Engine(tiny_profile(decode={"base_ms": 5.0, "per_seq_ms": 0.0, "per_context_token_ms": 0.0}, prefill_per_token_ms=0.0))
    busy, leg = Job(0, 1, 0, 100), Job(1, 1, 99, 5, pull_ms=1.0, pull="wanted")
    engine.submit(busy)
    step, _ = engine.plan(0.0)  # [0, 5): busy's prompt
    engine.submit(leg)
    engine.finish()
    step, pulls = engine.plan(5.0)  # [5, 10): admits the leg, whose pull this step's successor posts
    assert pulls == [leg] and engine.pull_posted_ms(5.0) == 10.0
    engine.finish()
    step, _ = engine.plan(10.0)  # busy decodes; the pull runs 10 -> 11
    engine.interrupt(11.0)
    engine.pulled(leg)
    assert engine.step.end_ms == 15.0
    engine.finish()
    step, _ = engine.plan(15.0)  # [15, 20): planned before the report of [10, 15) came
    assert [job for job, _ in step.tokens] == [busy] and step.count == 1
    engine.finish()
    step, _ = engine.plan(20.0)  # [20, 25): the decode row
    assert [job for job, _ in step.tokens] == [busy, leg]
    sampled, _ = engine.finish()
    assert leg in sampled and step.end_ms == 25.0


def test_on_an_idle_decode_worker_the_pull_is_posted_at_once_and_its_row_runs_when_it_is_done():
    engine = Engine(tiny_profile())
    leg = Job(1, 1, 99, 5, pull_ms=1.0, pull="wanted")
    engine.submit(leg)
    step, pulls = engine.plan(0.0)
    assert step is None and pulls == [leg] and engine.pull_posted_ms(0.0) == 0.0
    engine.pulled(leg)
    step, _ = engine.plan(1.0)
    assert [job for job, _ in step.tokens] == [leg]


def test_a_request_larger_than_the_cache_is_refused_before_it_would_wait_forever():
    with pytest.raises(ValueError, match="a request of 2000 tokens needs"):
        check_fits(tiny_profile(cache_bytes=100 * PAGE), fixed(1000, 1000, 1, concurrency=1))


def test_layouts_are_replicas_flexible_workers_and_every_split():
    assert [layout.name for layout in layouts(1)] == ["1 replicas", "1 flex"]
    assert [layout.name for layout in layouts(4)] == ["4 replicas", "4 flex", "1P3D", "2P2D", "3P1D"]


def test_layouts_with_workers_of_two_sizes_use_every_gpu_and_pair_only_sizes_that_divide():
    assert [layout.name for layout in layouts(4, (1, 2))] == [
        "4 replicas", "2 replicas (TP2)", "4 flex", "2 flex (TP2)",
        "1P3D", "2P2D", "2P(TP1)1D(TP2)", "1P(TP2)2D(TP1)", "1P(TP2)1D(TP2)", "3P1D",
    ]  # fmt: skip
    assert all(layout.gpus == 4 for layout in layouts(4, (1, 2)))
    # 5 GPUs would hold 1P(TP2)1D(TP3), but 2 and 3 divide neither way: the router would not pair them. 3 GPUs hold no TP2 worker whole.
    assert layouts(5, (2, 3)) == []
    assert [layout.name for layout in layouts(3, (2,))] == []


def test_each_role_runs_the_profile_of_its_size():
    """A TP2 decode worker twice as fast a step: TPOT halves; its prefill stays the TP1 worker's; it pulls the bytes of TP1 -> TP2 at its own rate."""
    one = tiny_profile()
    two = tiny_profile(tensor_parallel_size=2, decode={"base_ms": 2.5, "per_seq_ms": 0.25, "per_context_token_ms": 0.0005},
                       transfer={"latency_ms": 2.0, "bandwidth_gbps": 2.0})  # fmt: skip
    (o,) = simulate({1: one, 2: two}, Layout("pd", 1, 1, prefill_tp=1, decode_tp=2), fixed(100, 10, 1, concurrency=1))
    moved = plan_transfer(SHAPE, 100, 1, 2, block_size=16).total_bytes  # one KV head: both decode ranks read it
    assert moved > plan_transfer(SHAPE, 100, block_size=16).total_bytes
    prefill = 11.0 + 5.0 + 0.01 * 99  # the TP1 prefill worker's latency and step
    assert o.ttft_ms == pytest.approx(prefill + 3.0 + (2.0 + moved / 2e6) + (2.5 + 0.01 * 1))
    assert o.tpot_ms == pytest.approx(2.5 + 0.25 + 0.0005 * (100 + 108) / 2)
    assert predict({1: one, 2: two}, Layout("pd", 1, 1, 1, 2), fixed(100, 10, 1, concurrency=1), SLO(1e9, 1e9)).gpus == 3
    with pytest.raises(ValueError, match=r"1P\(TP1\)1D\(TP4\) has workers of tensor_parallel_size \[4\], and no profile"):
        simulate({1: one, 2: two}, Layout("pd", 1, 1, 1, 4), fixed(100, 10, 1, concurrency=1))


def test_size_lays_out_the_sizes_it_has_profiles_of():
    two = tiny_profile(tensor_parallel_size=2)
    got = size(two, fixed(100, 10, 20, concurrency=4), SLO(1e9, 1e9), [2, 4])
    assert [(p.gpus, p.layout) for p in got] == [(2, "1 replicas (TP2)"), (2, "1 flex (TP2)"), (4, "2 replicas (TP2)"),
                                                 (4, "2 flex (TP2)"), (4, "1P(TP2)1D(TP2)")]  # fmt: skip
    assert {(p.prefill_tp, p.decode_tp) for p in got} == {(2, 2)}


def test_lengths_parse_a_count_or_a_range():
    assert Lengths.parse("7") == Lengths(7, 7) and str(Lengths.parse("5-9")) == "5-9"
    for bad in ("0", "9-5", "x"):
        with pytest.raises(ValueError):
            Lengths.parse(bad)


def conversations(n: int, turns: int, system: int, user: int = 10, output: int = 5, concurrency: int = 1) -> Workload:
    return Workload(Lengths(user, user), Lengths(output, output), n, concurrency, None, 0, turns, system)


def test_a_conversation_is_its_turns_each_prompt_the_one_before_with_its_answer_and_a_new_message():
    requests = conversations(5, 3, 100).requests()  # rounded up to whole conversations
    assert [(r.conversation, r.prompt, r.earlier_prompt, r.earlier_output) for r in requests] == [
        (0, 110, 0, 0), (0, 125, 110, 5), (0, 140, 125, 5), (1, 110, 0, 0), (1, 125, 110, 5), (1, 140, 125, 5),
    ]  # fmt: skip
    assert conversations(6, 3, 100).longest_request == 100 + 3 * 15
    with pytest.raises(ValueError, match="closed loop"):
        Workload(Lengths(10, 10), Lengths(5, 5), 6, None, 1.0, 0, 3, 100)


def test_a_later_turn_on_a_replica_computes_only_what_its_prefix_cache_lacks():
    first, second = simulate(tiny_profile(), REPLICAS, conversations(2, 2, 100))
    assert first.ttft_ms == pytest.approx(10.0 + 10.0 * 110 / 1000 + 5.0 + 0.01 * 110)
    # Turn 2: 125 tokens, the first 115 (prompt and answer of turn 1) computed on this replica: it resumes at 112 (7 blocks).
    assert second.ttft_ms == pytest.approx(10.0 + 10.0 * 125 / 1000 + 5.0 + 0.01 * (125 - 112))


def test_a_later_turn_through_pd_resumes_on_both_workers_and_pulls_only_the_blocks_the_decode_worker_lacks():
    _, second = simulate(tiny_profile(), SPLIT, conversations(2, 2, 100))
    # The prefill worker computed turn 1's first 109 tokens: it resumes at 96 and computes 124 - 96 of turn 2's N-1 = 124.
    prefill = 10.0 + 10.0 * 125 / 1000 + 5.0 + 0.01 * (124 - 96)
    # The decode worker holds turn 1's 115 tokens up to 112: it pulls the block after them and the state.
    moved = plan_transfer(SHAPE, 125, block_size=16, decode_cached_tokens=112).total_bytes
    assert moved < plan_transfer(SHAPE, 125, block_size=16).total_bytes
    assert second.ttft_ms == pytest.approx(prefill + 3.0 + (1.0 + moved / 1e6) + (5.0 + 0.01 * 1))


def test_conversations_stay_on_their_workers_while_the_load_allows_as_the_routers_prefix_reuse():
    loads = [simulate_module._Load() for _ in range(2)]
    loads[0].legs, loads[1].legs = simulate_module.PREFIX_LOAD_SLACK + 1, 1
    assert simulate_module._pick(loads, [0, 1], 0) == 0, "within the slack: the worker holding the conversation"
    loads[0].legs += 1
    assert simulate_module._pick(loads, [0, 1], 0) == 1, "beyond it: the least loaded"
    assert simulate_module._pick(loads, [0, 1], None) == 1


def test_multi_turn_caching_lowers_later_turns_ttft_and_every_turn_is_answered():
    """Eight conversations of four turns on two replicas, against the same traffic as independent prompts of the same lengths."""
    profile = tiny_profile()
    turns = conversations(32, 4, 1000, user=100, output=50, concurrency=8)
    outcomes = simulate(profile, REPLICAS, turns)
    assert len(outcomes) == 32
    later = [o.ttft_ms for o in outcomes if o.request.earlier_prompt]
    alone = {r.prompt: simulate(profile, REPLICAS, fixed(r.prompt, 50, 1, concurrency=1))[0].ttft_ms for r in turns.requests()}
    assert all(o.ttft_ms < alone[o.request.prompt] for o in outcomes if o.request.earlier_prompt), later
