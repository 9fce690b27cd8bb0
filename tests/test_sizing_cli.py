"""``hybrid-pd size`` end to end on a small profile: the table, the JSON and the plot (bad input: tests/test_cli_usage_errors.py)."""

from __future__ import annotations

import json

from hybrid_pd.cli import main
from tests.sizing_support import tiny_profile


def test_size_lays_out_every_count_and_writes_json_and_a_plot(tmp_path, capsys):
    tiny_profile().save(tmp_path / "profile.json")
    argv = ["size", "--profile", str(tmp_path / "profile.json"), "--gpus", "3,1", "--input-len", "100-300", "--output-len", "20",
            "--concurrency", "8", "--slo-ttft-ms", "100", "--slo-tpot-ms", "8", "--json", str(tmp_path / "out" / "size.json"),
            "--plot", str(tmp_path / "out" / "size.png")]  # fmt: skip
    assert main(argv) == 0
    out = json.loads((tmp_path / "out" / "size.json").read_text())
    assert [(p["gpus"], p["layout"]) for p in out["predictions"]] == [
        (1, "1 replicas"), (1, "1 flex"), (3, "3 replicas"), (3, "3 flex"), (3, "1P2D"), (3, "2P1D")
    ]
    assert out["workload"] == {"input_len": "100-300", "output_len": "20", "num_prompts": 200, "concurrency": 8, "rate": None, "seed": 0, "turns": 1, "system_len": 0}
    assert out["profiles"] == [json.loads((tmp_path / "profile.json").read_text())] and set(out["best"]) == {"1", "3"}
    assert all(p["completed"] == 200 and 0 <= p["goodput_rps"] <= p["throughput_rps"] for p in out["predictions"])
    table = capsys.readouterr().out
    assert "1P2D" in table and "best per GPU count: 1: " in table
    assert (tmp_path / "out" / "size.png").read_bytes().startswith(b"\x89PNG")


def test_size_with_a_profile_per_worker_size_lays_out_both_sizes_and_mixes_them_in_splits(tmp_path, capsys):
    tiny_profile().save(tmp_path / "tp1.json")
    tiny_profile(tensor_parallel_size=2, cache_bytes=128 << 20).save(tmp_path / "tp2.json")
    argv = ["size", "--profile", str(tmp_path / "tp1.json"), "--profile", str(tmp_path / "tp2.json"), "--gpus", "3", "--input-len", "100",
            "--output-len", "20", "--concurrency", "8", "--slo-ttft-ms", "100", "--slo-tpot-ms", "8", "--json", str(tmp_path / "size.json")]  # fmt: skip
    assert main(argv) == 0
    out = json.loads((tmp_path / "size.json").read_text())
    assert [p["layout"] for p in out["predictions"]] == ["3 replicas", "3 flex", "1P2D", "1P(TP1)1D(TP2)", "2P1D", "1P(TP2)1D(TP1)"]
    assert [p["tensor_parallel_size"] for p in out["profiles"]] == [1, 2]
    assert "1P(TP2)1D(TP1)" in capsys.readouterr().out


def test_size_phases_simulates_the_planner_against_every_fixed_layout(tmp_path, capsys):
    tiny_profile().save(tmp_path / "profile.json")
    argv = ["size", "--profile", str(tmp_path / "profile.json"), "--gpus", "3", "--phases", "100-300/20@8x40,2000/5@4x20:1000/50",
            "--slo-ttft-ms", "100", "--slo-tpot-ms", "8", "--json", str(tmp_path / "phases.json")]  # fmt: skip
    assert main(argv) == 0
    table = [line.split() for line in capsys.readouterr().out.splitlines()[2:14]]
    # each phase, then the whole run: the planner first, then every fixed layout; each phase with the SLO it asks (else the run's)
    assert [(r[0], r[1], r[2]) for r in table[:4]] == [("1", "100/8", "planner"), ("1", "100/8", "3"), ("1", "100/8", "1P2D"), ("1", "100/8", "2P1D")]
    assert [r[:2] for r in table[4:8]] == [["2", "1000/50"]] * 4 and [r[:3] for r in table[8:10]] == [["all", "100/8,", "1000/50"]] * 2
    out = json.loads((tmp_path / "phases.json").read_text())
    assert [p["layout"] for p in out["predictions"]] == ["planner", "3 replicas", "1P2D", "2P1D"]
    assert all(p["completed"] == 60 for p in out["predictions"])
    assert [(p["phase"], p["slo_ms"], [q["completed"] for q in p["predictions"]]) for p in out["phase_predictions"]] == [
        ("100-300/20@8x40", "100/8", [40] * 4), ("2000/5@4x20:1000/50", "1000/50", [20] * 4)]
    assert out["planner"] == {"interval_s": 2.0, "window_s": 10.0, "margin": 0.1} and isinstance(out["changes"], list)
