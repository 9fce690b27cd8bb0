"""The profile: its memory and transfer arithmetic (from hybrid_pd.connector.plan), its latency table, its file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_pd.sizing.profile import Profile, ProfileError, profile_set
from tests.sizing_support import PAGE, tiny_profile

FITTED = Path(__file__).resolve().parent.parent / "hybrid_pd" / "bench" / "results" / "2026-11-25-h100x2-sizing" / "profile.json"


def test_nemotron_h_8b_moves_what_vllm_moved_and_8_gib_hold_63_sequences_of_1512_tokens():
    profile = Profile.load(FITTED)
    assert profile.transfer_plan(1000).total_bytes == 119_177_216  # vLLM's counters on the GPU (docs/models.md)
    page = 4_259_840  # one 1040-token attention block of one layer: the page every layer's state is padded to
    assert profile.memory_bytes(1512) == page * (24 + 4 * 2)  # a page per Mamba layer, a page per attention layer and block
    assert profile.cache_bytes // profile.memory_bytes(1512) == 63


def test_a_sequence_holds_its_state_pages_and_a_page_per_block_of_tokens():
    profile = tiny_profile()
    assert profile.memory_layout() == (2 * PAGE, PAGE)
    assert [profile.memory_bytes(n) for n in (1, 16, 17)] == [3 * PAGE, 3 * PAGE, 4 * PAGE]


def test_the_prompt_latency_table_is_linear_between_its_points_and_flat_beyond():
    profile = tiny_profile(prompt_latency_ms=[(100, 10.0), (300, 30.0), (500, 20.0)])
    assert [profile.prompt_latency_ms_at(n) for n in (0, 100, 200, 400, 500, 9000)] == [10.0, 10.0, 20.0, 25.0, 20.0, 20.0]


def test_a_profile_survives_its_file(tmp_path):
    profile = tiny_profile()
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"decode": {"base_ms": -1.0, "per_seq_ms": 0.1, "per_context_token_ms": 0.0}}, "decode.base_ms"),
        ({"prompt_latency_ms": [[500, 1.0], [100, 2.0]]}, "prompt_latency_ms"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"speed": 3}, "speed"),
    ],
)
def test_a_bad_profile_is_refused_naming_the_file_and_the_field(tmp_path, change, named):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**tiny_profile().model_dump(mode="json"), **change}))
    with pytest.raises(ProfileError, match=named) as error:
        Profile.load(path)
    assert str(path) in str(error.value)


def test_a_file_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "p.json").write_text("{nope")
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(tmp_path / "p.json")


def test_profiles_of_one_model_at_several_sizes_are_keyed_by_size_and_others_refused():
    one, two = tiny_profile(), tiny_profile(tensor_parallel_size=2, cache_bytes=128 << 20)
    assert profile_set([one, two]) == {1: one, 2: two}
    with pytest.raises(ProfileError, match="two profiles of tensor_parallel_size 1"):
        profile_set([one, tiny_profile(source="again")])
    with pytest.raises(ProfileError, match="differ in the model's shape or block_tokens"):
        profile_set([one, tiny_profile(tensor_parallel_size=2, block_tokens=32)])


def test_a_worker_of_two_gpus_holds_both_ranks_pages_replicated_heads_included():
    """One KV head and 16 state groups over 2 ranks: each rank keeps its own copy of what it cannot split (hybrid-pd plan's count)."""
    one, two = tiny_profile().memory_layout(), tiny_profile(tensor_parallel_size=2).memory_layout()
    assert two[0] > one[0] and two[1] > one[1]
    assert tiny_profile(tensor_parallel_size=2).transfer_plan(100).decode_rank_sources == {0: [0], 1: [1]}
    assert tiny_profile(tensor_parallel_size=2).transfer_plan(100, prefill_tp=1).decode_rank_sources == {0: [0], 1: [0]}


def test_the_kv_cache_holds_as_many_sequences_as_vllm_says_with_and_without_a_mamba_state_per_block():
    """vLLM 0.26 on an H200, Nemotron-H-8B, 8 GiB: 'Maximum concurrency for 4,096 tokens per request' 50.40x with prefix
    caching off (blocks of 1040 tokens), 16.25x with it on (Mamba cache mode 'all', blocks of 1152 tokens)."""
    off = Profile.load(FITTED)
    on = off.model_copy(update={"mamba_cache_mode": "all", "block_tokens": 1152})
    assert (off.block_tokens, off.cache_bytes) == (1040, 8 << 30)
    assert off.cache_bytes / off.memory_bytes(4096) == pytest.approx(50.40, abs=0.02)  # 50.41: vLLM counts whole pages of its pool
    assert on.cache_bytes / on.memory_bytes(4096) == pytest.approx(16.25, abs=0.02)
    assert on.memory_bytes(1) == on.memory_layout()[1] and on.memory_bytes(1153) == 2 * on.memory_bytes(1)
