"""The parsing and comparison logic of hybrid_pd/bench/gpu/pd_check.py (the GPU run itself needs an NVIDIA GPU)."""

import argparse

import pytest

from hybrid_pd.bench.gpu import pd_check, perf_sweep


def test_cudagraph_rows_reads_the_last_stats_table(tmp_path):
    log = tmp_path / "decode.log"
    log.write_text(
        "INFO **CUDAGraph Stats:**\n| 8 | 8 | 0 | CUDAGraphMode.FULL | 3 |\n"
        "INFO **CUDAGraph Stats:**\n"
        "INFO [cuda_graph.py:117] | Unpadded Tokens | Padded Tokens | Num Paddings | Runtime Mode | Count |\n"
        "INFO [cuda_graph.py:117] |-----------------|---------------|--------------|--------------|-------|\n"
        "INFO [cuda_graph.py:117] | 1               | 1             | 0            | FULL         | 1     |\n"
        "INFO [cuda_graph.py:117] | 999             | 1024          | 25           | CUDAGraphMode.PIECEWISE | 2 |\n"
    )
    assert pd_check.cudagraph_rows(log) == [(1, 1, "FULL", 1), (999, 1024, "CUDAGraphMode.PIECEWISE", 2)]
    empty = tmp_path / "none.log"
    empty.write_text("no stats here")
    assert pd_check.cudagraph_rows(empty) == []


def _choice(tokens, logprobs, tops):
    return {"token_ids": tokens, "logprobs": {"token_logprobs": logprobs, "top_logprobs": tops}}


def test_compare_reports_first_divergence_and_the_near_tie_there():
    pd = _choice([1, 2, 3], [-0.1, -0.5, -0.2], [{}, {}, {}])
    co = _choice([1, 2, 4], [-0.1, -0.52, -0.7], [{}, {}, {"a": -0.7, "b": -0.75}])
    result = pd_check.compare(pd, co)
    assert result["first_divergence"] == 2
    assert abs(result["top2_gap_at_divergence"] - 0.05) < 1e-9
    assert abs(result["max_logprob_delta_before"] - 0.02) < 1e-9


def test_compare_identical():
    same = _choice([1, 2], [-0.1, -0.2], [{}, {}])
    assert pd_check.compare(same, same)["first_divergence"] is None


def test_sweep_plots_each_layout_from_its_summary(tmp_path):
    dist = {"count": 10, "mean": 5.0, "p50": 4.0, "p90": 6.0, "p99": 9.0}
    level = {"pd": {k: dist for k in ("ttft_ms", "itl_ms", "e2e_ms")}, "baseline": {k: dist for k in ("ttft_ms", "itl_ms", "e2e_ms")}}
    summary = {"input_len": 1000, "output_len": 64, "layouts": {"one-gpu": {"1": level, "8": level}, "two-gpu": {"1": level}}}
    written = perf_sweep.plot_summary(summary, tmp_path)
    assert [p.name for p in written] == ["sweep-one-gpu.png", "sweep-two-gpu.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
    # several prompt lengths in one run: one plot per length and layout
    lengths = {"input_len": [1000, 8000], "output_len": 64, "sweeps": {"1000": {"layouts": {"one-gpu": {"1": level}}}, "8000": {"layouts": {"one-gpu": {"1": level}}}}}
    assert [p.name for p in perf_sweep.plot_summary(lengths, tmp_path)] == ["sweep-one-gpu-1000.png", "sweep-one-gpu-8000.png"]


def test_sweep_starts_only_the_servers_its_layouts_route_to_on_their_gpus(tmp_path):
    """A two-GPU run of an 8B model has no room (nor use) for the one-GPU layout's decode worker."""
    args = argparse.Namespace(out=tmp_path, device="cuda", gpu_memory_utilization=0.3, kv_cache_gib=16, max_model_len=4096)
    servers, routers = perf_sweep._servers(args, ["two-gpu"], tmp_path / "model", None)
    assert {name: s["gpu"] for name, s in servers.items()} == {"prefill": 0, "decode1": 1, "colocated0": 0, "colocated1": 1}
    assert set(routers) == {"two-gpu", "two-gpu-baseline"}
    assert all(s["argv"][s["argv"].index("--gpu-memory-utilization") + 1] == "0.3" for s in servers.values())
    both, _ = perf_sweep._servers(args, ["one-gpu", "two-gpu"], tmp_path / "model", None)
    assert set(both) == {"prefill", "decode0", "colocated0", "decode1", "colocated1"}


def test_sweep_with_the_timeline_traces_the_pd_workers_and_keeps_each_levels_budget(tmp_path):
    args = argparse.Namespace(out=tmp_path, device="cuda", gpu_memory_utilization=0.2, kv_cache_gib=8, max_model_len=4096)
    servers, _ = perf_sweep._servers(args, ["one-gpu"], tmp_path / "model", tmp_path / "timeline")
    traced = {name for name, s in servers.items() if str(tmp_path / "timeline") in s["argv"]}
    assert traced == {"prefill", "decode0"}  # the colocated baseline is not traced
    budget = {"group": "g", "requests": 2, "segments": {}, "ttft": {}, "per_request": [{}, {}]}
    report = {"timeline": {"levels": [{"load": {"kind": "concurrency", "value": 1}, **budget}]}}
    assert "per_request" not in perf_sweep._timeline_summary(report)["timeline"]
    assert perf_sweep._timeline_summary({}) == {}


def test_sweep_variants_add_their_own_workers_and_router_beside_the_unchanged_pd(tmp_path):
    variants = perf_sweep.parse_variants(
        ["await:decode=--pull-await-us=1000", "sync:decode=--vllm-arg=--no-async-scheduling", "sync:prefill=--vllm-arg=--no-async-scheduling"]
    )
    assert [(v.name, v.decode_flags, v.prefill_flags) for v in variants] == [
        ("await", ("--pull-await-us=1000",), None),
        ("sync", ("--vllm-arg=--no-async-scheduling",), ("--vllm-arg=--no-async-scheduling",)),
    ]
    args = argparse.Namespace(out=tmp_path, device="cuda", gpu_memory_utilization=0.1, kv_cache_gib=4, max_model_len=4096)
    servers, routers = perf_sweep._servers(args, ["one-gpu"], tmp_path / "model", tmp_path / "timeline", variants)
    assert routers["one-gpu-await"] == (["prefill"], ["decode0-await"])  # shares the unchanged prefill
    assert routers["one-gpu-sync"] == (["prefill-sync"], ["decode0-sync"])
    assert "--pull-await-us=1000" in servers["decode0-await"]["argv"]
    assert "--pull-await-us=1000" not in servers["decode0"]["argv"]
    assert "--vllm-arg=--no-async-scheduling" in servers["prefill-sync"]["argv"]
    assert "--vllm-arg=--no-async-scheduling" not in servers["prefill"]["argv"]
    assert all(str(tmp_path / "timeline") in servers[n]["argv"] for n in ("decode0-await", "prefill-sync", "decode0-sync"))
    assert perf_sweep._servers(args, ["two-gpu"], tmp_path / "model", None, variants)[1].keys() == {"two-gpu", "two-gpu-baseline"}


def test_a_router_variant_routes_the_unchanged_workers_through_a_router_of_its_own(tmp_path):
    """Issue #35: early decode legs (the default) against the legs one after the other, on the same prefill and decode workers."""
    (variant,) = perf_sweep.parse_variants(["sequential:router=--no-early-decode"])
    assert (variant.decode_flags, variant.prefill_flags, variant.router_flags) == (None, None, ("--no-early-decode",))
    args = argparse.Namespace(out=tmp_path, device="cuda", gpu_memory_utilization=0.3, kv_cache_gib=4, max_model_len=9216)
    servers, routers = perf_sweep._servers(args, ["one-gpu"], tmp_path / "model", tmp_path / "timeline", [variant])
    assert set(servers) == {"prefill", "decode0", "colocated0"} and routers["one-gpu-sequential"] == (["prefill"], ["decode0"])
    assert servers["decode0"]["argv"][servers["decode0"]["argv"].index("--max-model-len") + 1] == "9216"


@pytest.mark.parametrize("text", ["await", "await:decode", "await:other=--x", ":decode=--x", "await:prefill=--x"])
def test_a_variant_without_its_decode_worker_or_malformed_is_refused(text):
    with pytest.raises(ValueError, match="--variant"):
        perf_sweep.parse_variants([text])


def test_a_variants_level_keeps_the_unchanged_pds_budget_beside_its_own(tmp_path):
    budget = {"group": "g", "requests": 2, "segments": {}, "ttft": {}, "per_request": [{}, {}]}
    level = {"load": {"kind": "concurrency", "value": 1}, **budget}
    summary = perf_sweep._timeline_summary({"timeline": {"levels": [level], "baseline_levels": [level]}})
    assert set(summary) == {"timeline", "baseline_timeline"}
    assert "per_request" not in summary["baseline_timeline"]
