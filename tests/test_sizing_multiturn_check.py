"""The multi-turn check in docs/performance.md: the doc shows the table the code computes, from the committed run and profile."""

from __future__ import annotations

import json
from pathlib import Path

from hybrid_pd.sizing.multiturn_check import PROFILE, RUN, compare, markdown
from hybrid_pd.sizing.profile import Profile

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "python -m hybrid_pd.sizing.multiturn_check --json hybrid_pd/bench/results/2026-11-26-h200x2-multiturn/prediction.json"


def test_every_measured_row_is_predicted_and_the_docs_and_json_show_what_the_check_computes():
    run = json.loads(RUN.read_text())
    profile = Profile.load(PROFILE)
    assert (profile.mamba_cache_mode, profile.block_tokens) == ("all", 1152), "the run's caching: a state per block, blocks the engines logged"
    rows = compare(profile, run)
    assert [(r["system"], r["level"], r["salted"]) for r in rows] == [(r["system"], r["level"], r["salted"]) for r in run["rows"]]
    assert markdown(rows) in (ROOT / "docs" / "performance.md").read_text(), "regenerate: " + REGENERATE
    assert json.loads((RUN.parent / "prediction.json").read_text())["rows"] == json.loads(json.dumps(rows)), "regenerate: " + REGENERATE
