"""``hybrid-pd bench`` arithmetic on synthetic timings: percentiles, summaries, goodput, report fields."""

from __future__ import annotations

import json
import math

import pytest

from hybrid_pd.bench.client import RequestResult
from hybrid_pd.bench.prompts import random_prompts, vocab_size_of
from hybrid_pd.bench.report import EXIT_ERRORS, EXIT_OK, BenchConfig, build_report, format_table
from hybrid_pd.bench.runner import Target, TargetRun, parse_loads
from hybrid_pd.bench.stats import SLO, Distribution, percentile, summarize


def _ok(ttft: float, gaps: tuple[float, ...], tokens: int | None = None, prompt: int | None = 32) -> RequestResult:
    tokens = len(gaps) + 1 if tokens is None else tokens
    return RequestResult(
        sent_at=0.0,
        e2e_s=ttft + sum(gaps),
        ttft_s=ttft,
        itl_s=gaps,
        prompt_tokens=prompt,
        output_tokens=tokens,
        usage_reported=True,
    )


def _failed(error: str = "HTTP 500: boom") -> RequestResult:
    return RequestResult(sent_at=0.0, e2e_s=0.01, error=error, status=500)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1 and percentile([4, 1, 3, 2], 100) == 4
    assert percentile([10.0], 99) == 10.0
    assert percentile(list(range(101)), 90) == 90
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_distribution() -> None:
    d = Distribution.of([0.1, 0.2, 0.3, 0.4])
    assert d is not None and d.count == 4 and d.mean == pytest.approx(0.25) and d.p50 == pytest.approx(0.25)
    assert d.to_json_ms() == {"count": 4, "mean": 250.0, "p50": 250.0, "p90": 370.0, "p99": 397.0}
    assert Distribution.of([]) is None


def test_summary_counts_throughput_and_latencies() -> None:
    results = [
        _ok(0.1, (0.01, 0.01, 0.01)),  # 4 tokens, e2e 0.13
        _ok(0.3, (0.02, 0.02, 0.02)),  # 4 tokens, e2e 0.36
        _failed(),
        _failed(),
        _failed("ReadTimeout"),
    ]
    s = summarize(results, duration_s=2.0, input_len=32, output_len=4)
    assert (s.requests, s.completed, s.errors) == (5, 2, 3)
    assert s.output_tokens == 8 and s.input_tokens == 64
    assert s.request_throughput == 1.0 and s.output_throughput == 4.0
    assert s.ttft.p50 == pytest.approx(0.2) and s.ttft.count == 2
    assert s.itl.count == 6 and s.itl.p50 == pytest.approx(0.015)  # pooled over both requests' gaps
    assert s.tpot.count == 2 and s.tpot.mean == pytest.approx(0.015)
    assert s.e2e.p99 == pytest.approx(0.13 + 0.99 * (0.36 - 0.13))
    assert s.length_mismatches == 0 and s.usage_missing == 0
    assert s.goodput is None and s.slo_met is None  # no SLO given
    assert s.error_samples == (("HTTP 500: boom", 2), ("ReadTimeout", 1))


def test_goodput_needs_both_slos_and_success() -> None:
    results = [
        _ok(0.05, (0.01,) * 3),  # good
        _ok(0.50, (0.01,) * 3),  # TTFT too slow
        _ok(0.05, (0.05,) * 3),  # TPOT too slow
        _ok(0.05, ()),  # one token: no TPOT, meets the ITL SLO
        _failed(),
    ]
    s = summarize(results, duration_s=4.0, slo=SLO(ttft_s=0.1, itl_s=0.02))
    assert s.slo_met == 2 and s.goodput == 0.5
    assert summarize(results, 4.0, SLO(ttft_s=0.1)).slo_met == 3
    assert summarize(results, 4.0, SLO(itl_s=0.02)).slo_met == 3
    assert SLO().met(results[0]) and not SLO().met(results[4])


def test_length_mismatch_and_missing_usage_are_counted() -> None:
    short = _ok(0.1, (0.01,), tokens=2)
    guessed = RequestResult(sent_at=0.0, e2e_s=0.2, ttft_s=0.1, itl_s=(0.1,), output_tokens=4, usage_reported=False)
    s = summarize([short, guessed], 1.0, input_len=16, output_len=4)
    assert s.length_mismatches == 1 and s.usage_missing == 1
    assert s.input_tokens == 32 + 16  # usage said 32 for one; the other counts as input_len


def _report(errors: int = 0):
    loads = parse_loads("concurrency", "1,4")
    endpoint, baseline = Target("endpoint", "http://router", "m"), Target("baseline", "http://colocated", "m")
    runs = []
    for load in loads:
        good = tuple(_ok(0.1 * load.value, (0.01,) * 7) for _ in range(4))
        runs.append(
            [
                TargetRun(endpoint, load, good + tuple(_failed() for _ in range(errors)), 2.0),
                TargetRun(baseline, load, good, 1.0),
            ]
        )
    config = BenchConfig(
        input_len=32, output_len=8, num_prompts=4 + errors, seed=0, vocab_size=512, warmup=1, slo=SLO(ttft_s=0.2)
    )
    return build_report(config, [endpoint, baseline], runs)


def test_report_json_fields() -> None:
    report = _report()
    data = json.loads(json.dumps(report.to_json()))
    assert data["config"]["slo"] == {"ttft_ms": 200.0, "itl_ms": None} and data["errors"] == 0
    assert data["targets"]["baseline"] == {"url": "http://colocated", "model": "m"}
    assert [lv["load"] for lv in data["levels"]] == [{"kind": "concurrency", "value": 1}, {"kind": "concurrency", "value": 4}]
    first = data["levels"][0]
    assert first["endpoint"]["completed"] == 4 and first["endpoint"]["output_tokens"] == 32
    assert first["endpoint"]["request_throughput"] == 2.0 and first["baseline"]["request_throughput"] == 4.0
    assert first["endpoint"]["ttft_ms"]["p50"] == 100.0 and first["endpoint"]["itl_ms"]["count"] == 28
    assert first["endpoint"]["goodput"] == 2.0 and data["levels"][1]["endpoint"]["slo_met"] == 0  # TTFT 400 ms
    assert len(first["endpoint"]["per_request"]) == 4 and first["endpoint"]["per_request"][0]["output_tokens"] == 8
    assert "per_request" not in report.to_json(requests=False)["levels"][0]["endpoint"]
    assert report.exit_code == EXIT_OK


def test_table_shows_every_level_and_target_and_the_errors() -> None:
    report = _report(errors=2)
    table = format_table(report)
    rows = [line for line in table.splitlines() if line.startswith(("c=1 ", "c=4 "))]
    assert len(rows) == 4 and rows[0].split()[:4] == ["c=1", "endpoint", "4", "2"]
    assert "100/100/100" in rows[0]  # TTFT p50/p90/p99 in ms
    assert "endpoint c=1: error x2: HTTP 500: boom" in table
    assert "TTFT <= 200 ms" in table
    assert report.errors == 4 and report.exit_code == EXIT_ERRORS


def test_loads_parse() -> None:
    assert [ld.label for ld in parse_loads("concurrency", "1, 8,32")] == ["c=1", "c=8", "c=32"]
    assert [ld.label for ld in parse_loads("rate", "0.5,inf")] == ["rate=0.5/s", "rate=inf"]
    for kind, text in (("concurrency", "0"), ("concurrency", "1.5"), ("rate", "-1"), ("rate", "")):
        with pytest.raises(ValueError):
            parse_loads(kind, text)  # type: ignore[arg-type]


def test_prompts_are_seeded_exact_length_and_inside_the_vocabulary() -> None:
    a = random_prompts(5, 33, 100, seed=7)
    assert a == random_prompts(5, 33, 100, seed=7) and a != random_prompts(5, 33, 100, seed=8)
    assert all(len(p) == 33 and all(0 <= t < 100 for t in p) for p in a)


def test_vocab_size_from_a_model_directory(tmp_path) -> None:
    assert vocab_size_of(None) is None and vocab_size_of(tmp_path / "missing") is None
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1024}))
    assert vocab_size_of(tmp_path) == 1024
    tokenizer = {"model": {"vocab": {"a": 0, "b": 1, "c": 499}}, "added_tokens": [{"id": 500, "content": "<eos>"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert vocab_size_of(tmp_path) == 501  # the tokenizer's largest id + 1, below the padded embedding
