"""The multi-turn checks in docs/performance.md: the doc shows the table the code computes, from the committed runs and profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_pd.sizing.multiturn_check import PROFILE, RUN, compare, markdown
from hybrid_pd.sizing.profile import Profile

ROOT = Path(__file__).resolve().parent.parent
# The 2026-11-26 run (replicas, 1P1D, flexible workers) and the 2026-11-28 timeline runs (1P1D, its prefill's scheduling either way).
RUNS = [RUN, RUN.parent.parent / "2026-11-28-gpu-multiturn-timeline" / "summary.json"]


@pytest.mark.parametrize("run_path", RUNS, ids=lambda p: p.parent.name)
def test_every_measured_row_is_predicted_and_the_docs_and_json_show_what_the_check_computes(run_path):
    regenerate = f"python -m hybrid_pd.sizing.multiturn_check --run {run_path.relative_to(ROOT)} --json {(run_path.parent / 'prediction.json').relative_to(ROOT)}"
    run = json.loads(run_path.read_text())
    profile = Profile.load(PROFILE)
    assert (profile.mamba_cache_mode, profile.block_tokens) == ("all", 1152), "the run's caching: a state per block, blocks the engines logged"
    rows = compare(profile, run)
    assert [(r["system"], r["level"], r["salted"]) for r in rows] == [(r["system"], r["level"], r["salted"]) for r in run["rows"]]
    assert markdown(rows) in (ROOT / "docs" / "performance.md").read_text(), "regenerate: " + regenerate
    assert json.loads((run_path.parent / "prediction.json").read_text())["rows"] == json.loads(json.dumps(rows)), "regenerate: " + regenerate
