"""The arithmetic of hybrid_pd/bench/gpu/goodput.py: goodput per SLO pair from vLLM's per-request results, its tables,
the systems as layouts over N GPUs, the points and phases, and the archive of a run.

The GPU run itself needs the GPUs; tests/e2e/test_flex.py runs the runner on CPU.
"""

from __future__ import annotations

import argparse
import json
import tarfile

import pytest

from hybrid_pd.bench.gpu.goodput import (
    SYSTEMS,
    Point,
    _system_order,
    Workload,
    _server_flags,
    matrix_points,
    needed_servers,
    parse_args,
    phase_table,
    planner_lines,
    settle_prompts,
    span_summary,
    span_table,
    summarize,
    summarize_run,
    system,
    table,
    attach_waves,
    wave_table,
    waves,
)
from hybrid_pd.bench.gpu.goodput import main as runner
from hybrid_pd.sizing.layouts import RUNNER_SYSTEMS, layouts


def _result(ttfts, latencies, output_lens, errors=None, duration=2.0):
    n = len(ttfts)
    return {"ttfts": ttfts, "latencies": latencies, "output_lens": output_lens, "itls": [[0.01] * (o - 1) for o in output_lens],
            "errors": errors or [""] * n, "duration": duration, "request_goodput": None}  # fmt: skip


def test_a_closed_loops_waves_are_its_requests_in_start_order_by_the_requests_in_flight():
    # Started at 0.0 (TTFT 0.6 s), 0.0 (0.1 s), 2.0 (0.1 s), 2.0 (0.1 s, failed), 4.0 (0.2 s): listed out of order.
    result = {**_result([0.1, 0.1, 0.6, 0.2, 0.1], [1.1, 3.1, 1.6, 1.2, 0.1], [101, 101, 101, 101, 0], errors=["", "", "", "", "boom"]),
              "start_times": [0.0, 2.0, 0.0, 4.0, 2.0], "max_concurrency": 2}  # fmt: skip
    got = waves(result, (500, 20))
    assert [w["requests"] for w in got] == [2, 2, 1]
    assert [w["within_slo"] for w in got] == [0.5, 0.0, 1.0]  # the 0.6 s TTFT; TPOT 30 ms, the failed one; 0.2 s and 10 ms
    assert (got[0]["ttft_p50_ms"], got[1]["tpot_p50_ms"], got[2]["ttft_p50_ms"]) == (pytest.approx(350.0), pytest.approx(30.0), pytest.approx(200.0))
    phase = {"phase": 0, "waves": got}
    row = {"system": "replicas", "workload": "1000/512", "level": 2, "waves": got[:1]}
    assert wave_table([row], [{"system": "planner", "phases": [phase]}]).splitlines()[2:] == [
        "| 1000/512 @ 2 | replicas | 50% 350.0/10.0 |", "| phase 1 | planner | 50% 350.0/10.0 · 0% 100.0/30.0 · 100% 200.0/10.0 |"]


def test_the_report_reads_each_rows_and_phases_waves_from_the_runs_own_results(tmp_path):
    result = {**_result([0.1, 0.6], [1.1, 1.6], [101, 101]), "start_times": [0.0, 0.0], "max_concurrency": 2}
    (tmp_path / "runs").mkdir()
    (tmp_path / "phases").mkdir()
    (tmp_path / "runs" / "replicas-1000x512-c2-slo500-20.json").write_text(json.dumps(result))
    (tmp_path / "phases" / "planner-p0.json").write_text(json.dumps(result))
    rows = [{"system": "replicas", "workload": "1000/512", "level": 2, "slo": "500/20"}, {"system": "1P1D", "workload": "1000/512", "level": 2}]
    runs = [{"system": "planner", "phases": [{"phase": 0, "slo": "4000/15"}]}]
    attach_waves(tmp_path, rows, runs)
    assert rows[0]["waves"][0]["within_slo"] == 0.5 and "waves" not in rows[1]  # 0.6 s misses 500 ms; a row without results has none
    assert runs[0]["phases"][0]["waves"][0]["within_slo"] == 1.0  # both within 4000/15


def test_goodput_counts_requests_within_both_targets_per_pair_and_per_gpu():
    # TTFT 0.1 s, TPOT (1.1 - 0.1) / 100 = 10 ms; TTFT 0.6 s, TPOT 10 ms; TTFT 0.1 s, TPOT 30 ms; a failed one.
    result = _result([0.1, 0.6, 0.1, 0.05], [1.1, 1.6, 3.1, 0.1], [101, 101, 101, 0], errors=["", "", "", "boom"])
    s = summarize(result, [(500, 20), (1500, 50)], gpus=2)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["goodput"]["500/20"] == {"req_s": 0.5, "per_gpu": 0.25}  # only the first: 1 request in 2 s
    assert s["goodput"]["1500/50"] == {"req_s": 1.5, "per_gpu": 0.75}
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 151.5
    assert s["tpot_ms"]["mean"] == pytest.approx((10 + 10 + 30) / 3)
    assert s["ttft_ms"]["p50"] == pytest.approx(100)
    assert "target" not in s  # no SLO of its own
    # Its own SLO pair: TTFT 700 ms binds the second request in, TPOT 15 ms keeps the third out.
    own = summarize(result, [(500, 20)], gpus=4, target=(700, 15))
    assert own["target"] == {"slo": "700/15", "good": 2, "req_s": 1.0, "per_gpu": 0.25}
    assert own["goodput"]["700/15"] == {"req_s": 1.0, "per_gpu": 0.25}


def test_a_one_token_answer_has_no_tpot_to_break():
    s = summarize(_result([0.2], [0.2], [1]), [(500, 20)], gpus=1)
    assert s["goodput"]["500/20"]["req_s"] == 0.5 and s["tpot_ms"]["mean"] == 0


def test_phases_add_up_over_their_durations_each_request_judged_by_its_phase():
    chat = _result([0.1, 0.6], [1.1, 1.6], [101, 101], duration=2.0)  # TPOT 10 ms both; TTFT 100 and 600 ms
    documents = _result([3.0, 5.0], [4.5, 6.5], [101, 101], duration=6.0)  # TTFT 3 and 5 s, TPOT 15 ms
    whole = summarize_run([(chat, (500, 20)), (documents, (4000, 20))], [(500, 20)], gpus=2)
    # Good: 1 of chat (TTFT 600 > 500), 1 of documents (5 s > 4 s): 2 in 8 s.
    assert whole["target"] == {"slo": "500/20, 4000/20", "good": 2, "req_s": 0.25, "per_gpu": 0.125}
    assert whole["goodput"]["500/20"]["req_s"] == pytest.approx(1 / 8)  # one pair for all: only the first chat request
    assert (whole["completed"], whole["duration_s"], whole["request_throughput"]) == (4, 8.0, 0.5)
    assert whole["ttft_ms"]["p50"] == pytest.approx(1800)  # of 100, 600, 3000, 5000
    same = summarize_run([(chat, (500, 20)), (chat, (500, 20))], [], gpus=1)
    assert same["target"]["slo"] == "500/20" and same["target"]["req_s"] == pytest.approx(0.5)


def test_the_table_sets_every_system_against_the_replicas_at_the_same_point_and_slo():
    fast = summarize(_result([0.1] * 4, [1.1] * 4, [101] * 4), [(500, 20)], gpus=2)
    slow = summarize(_result([0.1, 0.1, 0.9, 0.9], [1.1, 1.1, 1.9, 1.9], [101] * 4), [(500, 20)], gpus=2)
    decisions = {"hybrid_pd_disaggregated_total": 3.0, "hybrid_pd_fallbacks_total": 1.0}  # the share the router split
    rows = [{"system": "replicas", "workload": "1000/64", "level": 32, "summary": slow},
            {"system": "adaptive", "workload": "1000/64", "level": 32, "summary": fast, "router_decisions": decisions}]  # fmt: skip
    text = table(rows, ["500/20"])
    assert "| 1000/64 | 32 | 500/20 | adaptive | 2.00 | 1.00 | 10.0 | 10.0 | 100.0 | 100.0 | 2.00x | 1.00x | 75% |" in text
    assert "| 1000/64 | 32 | 500/20 | replicas | 2.00 | 0.50 |" in text
    # Points with an SLO of their own: compared with the replicas under the same pair only; --slo's other pairs as columns.
    loose = [(1000, 20), (500, 20)]
    rows = [{"system": "replicas", "workload": "1000/64", "level": 32, "summary": summarize(_result([0.1, 0.1, 0.9, 0.9], [1.1, 1.1, 1.9, 1.9], [101] * 4), loose, 2, (1000, 20))},
            {"system": "1P1D", "workload": "1000/64", "level": 32, "summary": summarize(_result([0.1] * 2 + [0.9] * 2, [1.1] * 2 + [3.9] * 2, [101] * 4), loose, 2, (1000, 20))},
            {"system": "replicas", "workload": "1000/64", "level": 32, "summary": slow},
            {"system": "1P1D", "workload": "1000/64", "level": 32, "error": "RuntimeError: router 1P1D did not start"}]  # fmt: skip
    text = table(rows, ["500/20", "1000/20"])
    assert "| workload | in flight | SLO | system | req/s | goodput /GPU | goodput 1000/20 /GPU |" in text
    assert "| 1000/64 | 32 | 1000/20 | replicas | 2.00 | 1.00 | 1.00 |" in text
    assert "| 1000/64 | 32 | 1000/20 | 1P1D | 2.00 | 0.50 | 0.50 | 20.0 | 30.0 | 500.0 | 900.0 | 0.50x | 1.00x | - |" in text
    assert "| 1000/64 | 32 | 500/20 | replicas | 2.00 | 0.50 | - |" in text and "did not start" not in text


def test_the_phase_table_has_each_phase_and_the_whole_run_against_the_replicas():
    chat, documents = _result([0.1, 0.6], [1.1, 1.6], [101, 101]), _result([3.0, 5.0], [4.5, 6.5], [101, 101], duration=6.0)

    def run(name, parts):
        split = {"hybrid_pd_disaggregated_total": 0.0 if name == "replicas" else 2.0, "hybrid_pd_fallbacks_total": 2.0 if name == "replicas" else 0.0}
        phases = [{"phase": i, "point": p, "summary": summarize(r, [], 4, t), "router_decisions": split} for i, (p, r, t) in enumerate(parts)]
        return {"system": name, "phases": phases, "whole": {"summary": summarize_run([(r, t) for _, r, t in parts], [], 4)}}

    runs = [run("replicas", [("1000/512@64", chat, (500, 20)), ("16000/256@32", documents, (4000, 20))]),
            run("planner", [("1000/512@64", chat, (700, 20)), ("16000/256@32", documents, (6000, 20))]),
            {"system": "3P1D", "phases": [], "error": "RuntimeError: boom"}]  # fmt: skip
    text = phase_table(runs)
    assert "| 1 | 1000/512@64 | 700/20 | planner | 1.00 | 0.25 | 2.00x | 1.00x | 10.0 | 10.0 | 350.0 | 595.0 | 2 | 100% |" in text
    assert "| 2 | 16000/256@32 | 4000/20 | replicas | 0.33 | 0.04 | 1.00x | 1.00x | 15.0 | 15.0 | 4000.0 | 4980.0 | 6 | 0% |" in text
    assert "| all | 1000/512@64 -> 16000/256@32 | 700/20, 6000/20 | planner | 0.50 | 0.12 | 2.00x | 1.00x |" in text
    assert "3P1D" not in text


def test_points_carry_lengths_in_flight_prompts_and_slo():
    assert Point.parse("16000/256@32x128:4000/15") == Point(16000, 256, 32, 128, (4000.0, 15.0))
    assert Point.parse("1000/512@64") == Point(1000, 512, 64)
    assert Point.parse("1000/512@64:500/20.5").slo == (500.0, 20.5)
    for text in ("1000/512@64x90s", "1000/512", "1000@64", "1000/512@0", "1000/512@64:500", "1000/512@64x0"):
        with pytest.raises(argparse.ArgumentTypeError):
            Point.parse(text)
    assert str(Point.parse("16000/256@32x128:4000/15")) == "16000/256@32x128:4000/15" and str(Workload.parse("3000/128")) == "3000/128"
    args = parse_args(["run", "--out", "/tmp/x", "--model", "/tmp/x", "--slo", "400/30", "--prompts-per-in-flight", "2", "--min-prompts", "3"])
    assert (Point(1000, 512, 1).target(args), Point(1000, 512, 1).prompt_count(args), Point(1000, 512, 64).prompt_count(args)) == ((400, 30), 3, 128)
    assert Point(1000, 512, 64, 500, (500, 20)).target(args) == (500, 20) and Point(1000, 512, 64, 500).prompt_count(args) == 500


def test_every_system_settles_on_the_same_prompts_before_its_measured_run_not_the_planner_alone():
    """Settled alone, the planner was measured on warm servers and the others on servers idle for minutes (1.54x at @64)."""
    args = parse_args(["run", "--out", "/tmp/x", "--model", "/tmp/x", "--settle-prompts-per-in-flight", "2"])
    assert settle_prompts(Point(1000, 512, 64), args) == 128
    assert settle_prompts(Point(1000, 512, 64), parse_args(["run", "--out", "/tmp/x", "--model", "/tmp/x"])) == 0  # none by default, as before


def test_the_matrix_is_the_points_or_every_workload_at_every_level_and_none_beside_phases_alone():
    base = ["run", "--out", "/tmp/x", "--model", "/tmp/x"]
    assert matrix_points(parse_args([*base, "--points", "1000/512@128:500/20,32000/128@16"])) == [Point(1000, 512, 128, None, (500, 20)), Point(32000, 128, 16)]
    assert matrix_points(parse_args([*base, "--workloads", "3000/128,200/1000", "--levels", "1,64"])) == [
        Point(3000, 128, 1), Point(3000, 128, 64), Point(200, 1000, 1), Point(200, 1000, 64)]
    assert matrix_points(parse_args(base)) == [Point(1000, 512, 1), Point(1000, 512, 32)]
    phases = parse_args([*base, "--phases", "1000/512@64x480:500/20,16000/256@32x128:4000/15"])
    assert matrix_points(phases) == [] and phases.phases[1] == Point(16000, 256, 32, 128, (4000, 15))


def test_systems_are_layouts_over_a_colocated_server_and_a_flex_worker_per_gpu():
    urls = {name: f"http://{name}" for name in needed_servers(["replicas", "flex"], 4)}
    assert list(urls) == ["colocated0", "flex0", "colocated1", "flex1", "colocated2", "flex2", "colocated3", "flex3"]
    argv = {name: system(name, 4).router_argv(urls, (4000, 15), 9000, "/p.json") for name in ("replicas", "1P3D", "3P1D", "flex", "planner")}
    assert argv["replicas"][-8:] == [a for i in range(4) for a in ("--decode", f"http://colocated{i}")]
    assert argv["1P3D"][-8:] == ["--prefill", "http://flex0", "--decode", "http://flex1", "--decode", "http://flex2", "--decode", "http://flex3"]
    assert argv["3P1D"][-8:] == ["--prefill", "http://flex0", "--prefill", "http://flex1", "--prefill", "http://flex2", "--decode", "http://flex3"]
    assert argv["flex"][-8:] == [a for i in range(4) for a in ("--flex", f"http://flex{i}")]
    assert argv["planner"][-14:] == [*argv["flex"][-8:], "--slo-ttft-ms", "4000", "--slo-tpot-ms", "15", "--planner-profile", "/p.json"]
    with pytest.raises(ValueError, match="--planner-profile"):
        system("planner", 4).router_argv(urls, (500, 20), 9000)
    assert needed_servers(["1P3D", "planner"], 4) == ["flex0", "flex1", "flex2", "flex3"]
    assert system("pd", 2) == system("1P1D", 2) and system("2P6D", 8).legs[2] == ("--decode", "flex2")
    for name, gpus, error in (("2P3D", 4, "not the 4 GPUs"), ("pd", 4, "unknown system"), ("0P4D", 4, "unknown"), ("split", 2, "unknown")):
        with pytest.raises(ValueError, match=error):
            system(name, gpus)
    with pytest.raises(SystemExit):
        parse_args(["run", "--out", "/tmp/x", "--model", "/tmp/x", "--gpus", "4", "--systems", "replicas,1P1D"])
    with pytest.raises(SystemExit):  # the planner's router cannot start without the profile
        parse_args(["run", "--out", "/tmp/x", "--model", "/tmp/x", "--gpus", "4", "--systems", "planner"])
    assert parse_args(["report", "--out", "/tmp/x", "--model", "/tmp/x", "--gpus", "4"]).systems == ["replicas", "1P3D", "adaptive"]


def test_a_sequential_split_is_the_split_whose_router_sends_its_legs_one_after_the_other():
    """Issue #35's before/after on one set of servers: the same workers, the router's early decode legs off."""
    urls = {name: f"http://{name}" for name in needed_servers(["1P1D"], 2)}
    early, sequential = system("1P1D", 2), system("1P1D-sequential", 2)
    assert sequential.legs == early.legs and needed_servers(["1P1D-sequential"], 2) == ["flex0", "flex1"]
    assert sequential.router_argv(urls, (500, 20), 9000)[-1] == "--no-early-decode"
    assert "--no-early-decode" not in early.router_argv(urls, (500, 20), 9000)
    assert sorted(["1P1D-sequential", "replicas", "1P1D"], key=_system_order) == ["replicas", "1P1D", "1P1D-sequential"]


def test_the_routers_spans_are_summarised_and_tabled_per_run():
    spans = span_summary({"prefill_leg": [0.010, 0.030, 0.020], "decode_leg": [], "after_prefill": [0.005], "ttft": [0.04]})
    assert spans["prefill_leg"] == {"p50": 20.0, "mean": 20.0, "n": 3} and spans["decode_leg"] == {"p50": None, "mean": None, "n": 0}
    text = span_table([{"workload": "1000/32", "level": 1, "system": "1P1D", "router_spans_ms": spans}, {"workload": "1000/32", "level": 1, "system": "replicas"}])
    assert text.splitlines()[2] == "| 1000/32 | 1 | 1P1D | 20.0 / 20.0 | - | 5.0 / 5.0 | 40.0 / 40.0 |" and len(text.splitlines()) == 3


def test_every_split_the_simulator_lays_out_is_a_runner_system_of_as_many_workers():
    """hybrid-pd size names splits as the runner does (1P3D): each names the same workers in both."""
    for gpus in (2, 4, 8):
        splits = [layout for layout in layouts(gpus) if layout.kind == "pd"]
        assert len(splits) == gpus - 1
        for layout in splits:
            legs = [flag for flag, _ in system(layout.name, gpus).legs]
            assert (legs.count("--prefill"), legs.count("--decode")) == (layout.prefill, layout.decode)


def test_the_detached_server_process_gets_the_runs_gpus_systems_and_server_flags(tmp_path):
    """``run`` starts ``serve`` in another process from these flags; routers are the run's own, so their flags stay with it."""
    args = parse_args(["run", "--out", str(tmp_path), "--model", str(tmp_path), "--gpus", "4", "--systems", "3P1D,replicas",
                       "--server-arg=--vllm-arg=--enable-prefix-caching", "--max-model-len", "33280", "--kv-cache-gib", "14",
                       "--gpu-memory-utilization", "0.47", "--max-num-seqs", "128", "--router-arg=--decode-policy=prefix_reuse"])  # fmt: skip
    again = parse_args(["serve", *_server_flags(args)])
    assert (again.gpus, again.systems, again.server_arg) == (4, ["3P1D", "replicas"], ["--vllm-arg=--enable-prefix-caching"])
    assert (again.max_model_len, again.kv_cache_gib, again.gpu_memory_utilization, again.max_num_seqs) == (33280, 14, 0.47, 128)
    assert needed_servers(again.systems, again.gpus) == needed_servers(["replicas", "flex"], 4)


def test_the_simulator_lays_out_each_runner_system_on_as_many_gpus():
    """The sizing checks read the two-GPU runs' rows by system name (hybrid_pd.sizing.layouts.RUNNER_SYSTEMS)."""
    assert set(RUNNER_SYSTEMS) == set(SYSTEMS)
    assert {name: layout.gpus for name, layout in RUNNER_SYSTEMS.items()} == {name: len(s.legs) for name, s in SYSTEMS.items()}


def test_only_the_planners_metric_lines_are_kept():
    text = "\n".join(["# HELP hybrid_pd_planner_moves Times", "# TYPE hybrid_pd_planner_moves counter", "hybrid_pd_planner_moves 3.0",
                      'hybrid_pd_planner_predicted_goodput_per_gpu{layout="1P3D"} 2.4', "# HELP hybrid_pd_requests_total x",
                      "hybrid_pd_requests_total 10", "hybrid_pd_disaggregated_total 4"])  # fmt: skip
    assert planner_lines(text) == text.splitlines()[:4]


def test_pack_writes_one_archive_with_vllms_results_made_small(tmp_path):
    out = tmp_path / "run"
    (out / "runs").mkdir(parents=True)
    (out / "logs").mkdir()
    detailed = {**_result([0.123456789], [1.0], [3]), "generated_texts": ["x" * 1000], "itls": [[0.0123456789, 0.02]]}
    (out / "runs" / "replicas-1000x512-c64-slo500-20.json").write_text(json.dumps(detailed))
    (out / "runs" / "replicas-1000x512-c64-slo500-20.row.json").write_text('{"system": "replicas"}')
    (out / "logs" / "flex0.log").write_text("old line\n" * 1000 + "last line\n")
    (out / "summary.json").write_text("{}")
    (out / "servers.json").write_text("{}")
    assert runner(["pack", "--out", str(out), "--model", str(out), "--to", str(tmp_path / "out" / "results.tar.gz"), "--log-tail-mib", "0.00001"]) == 0
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        names = sorted(tar.getnames())
        assert names == ["run/logs/flex0.log", "run/runs/replicas-1000x512-c64-slo500-20.json", "run/runs/replicas-1000x512-c64-slo500-20.row.json", "run/summary.json"]
        small = json.loads(tar.extractfile("run/runs/replicas-1000x512-c64-slo500-20.json").read())
        assert "generated_texts" not in small and small["ttfts"] == [0.12346] and small["itls"] == [[0.01235, 0.02]]
        packed, original = summarize(small, [(500, 20)], 1), summarize(detailed, [(500, 20)], 1)  # what a report reads: the same to 10 us
        assert (packed["goodput"], packed["completed"]) == (original["goodput"], original["completed"])
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert packed[metric] == pytest.approx(original[metric], abs=0.01)
        assert tar.extractfile("run/logs/flex0.log").read().endswith(b"last line\n") and tar.getmember("run/logs/flex0.log").size == 10
