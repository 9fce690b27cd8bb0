"""The projection to 8, 16 and 64 GPUs in docs/sizing.md: the doc shows what the committed projection holds, and that
projection is what the code simulates (cells recomputed: all of 64 GPUs takes minutes, so a sample of 8 GPUs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_pd.sizing.layouts import Layout, layouts
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.projection import GPUS, SLOS, WORKLOADS, cell, commands, markdown

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "hybrid_pd" / "bench" / "results" / "2026-11-25-h100x2-sizing"
REGENERATE = "python -m hybrid_pd.sizing.projection --profile hybrid_pd/bench/results/2026-11-25-h100x2-sizing/profile.json --json " \
             "hybrid_pd/bench/results/2026-11-25-h100x2-sizing/projection-8-16-64.json"  # fmt: skip


@pytest.fixture(scope="module")
def projection() -> dict:
    return json.loads((RESULTS / "projection-8-16-64.json").read_text())


def test_every_cell_and_layout_is_projected(projection):
    got = {(c["gpus"], c["input_len"], c["output_len"], c["slo_ms"]): [p["layout"] for p in c["predictions"]] for c in projection["cells"]}
    assert got == {(g, i, o, str(s)): [x.name for x in layouts(g)] for g in GPUS for i, o in WORKLOADS for s in SLOS}


def test_docs_show_the_committed_projection_and_its_commands(projection):
    doc = (ROOT / "docs" / "sizing.md").read_text()
    assert markdown(projection["cells"]) in doc, "regenerate: " + REGENERATE
    assert commands(projection["profile"]) in doc


@pytest.mark.parametrize(("layout", "workload"), [(Layout("pd", 2, 6), (1000, 512)), (Layout("replicas", 0, 8), (3000, 128))])
def test_the_committed_projection_is_what_the_simulator_predicts(projection, layout, workload):
    profile = Profile.load(ROOT / projection["profile"])
    want = [next(p for p in c["predictions"] if p["layout"] == layout.name) for slo in SLOS for c in projection["cells"]
            if (c["gpus"], c["input_len"], c["output_len"], c["slo_ms"]) == (8, *workload, str(slo))]  # fmt: skip
    assert cell(profile, layout, 8, *workload) == want, "regenerate: " + REGENERATE
