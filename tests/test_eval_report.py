"""Confidence intervals, the endpoint comparison, the pass/fail gate and its exit codes, the reports."""

from __future__ import annotations

import io
import json

import pytest

from hybrid_pd.eval.client import Generation, base_url
from hybrid_pd.eval.data import Problem
from hybrid_pd.eval.progress import Progress
from hybrid_pd.eval.report import (
    EXIT_ERRORS,
    EXIT_GATE,
    EXIT_OK,
    EndpointRun,
    Gate,
    RunInfo,
    compare,
    format_report,
    json_report,
)
from hybrid_pd.eval.stats import paired_difference, wilson

PROBLEMS = [Problem(f"What is {i} + 1?", f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}") for i in range(20)]
INFO = RunInfo(task="gsm8k", dataset="test", shots=0, max_tokens=16, stop=("Question:",))


def run(role: str, wrong: set[int] = frozenset(), failed: set[int] = frozenset(), suffix: str = "") -> EndpointRun:
    """A scored run that answers every problem right except ``wrong`` ones and fails ``failed`` ones."""
    generations = [
        Generation(None, "HTTP 500: boom")
        if i in failed
        else Generation(f" so #### {int(p.target) + (1 if i in wrong else 0)}{suffix}", finish_reason="stop")
        for i, p in enumerate(PROBLEMS)
    ]
    return EndpointRun.scored(role, f"http://{role}:8000", "m", PROBLEMS, generations, wall_s=1.0)


def test_wilson_interval() -> None:
    i = wilson(8, 10)
    assert i.value == 0.8
    assert i.low == pytest.approx(0.4902, abs=1e-4) and i.high == pytest.approx(0.9433, abs=1e-4)
    assert wilson(0, 50).low == 0.0 and 0 < wilson(0, 50).high < 0.1
    assert wilson(50, 50).high == 1.0 and 0.9 < wilson(50, 50).low < 1.0
    assert wilson(0, 0).value == 0.0
    n = 1319  # the full GSM8K test set: about +-2.7 points at 50%
    half = (wilson(660, n).high - wilson(660, n).low) / 2
    assert half == pytest.approx(0.0269, abs=5e-4)
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_paired_difference() -> None:
    d = paired_difference([True, True, False, False], [True, False, False, False])
    assert (
        d.value == 0.25
        and d.low == pytest.approx(0.25 - 1.959964 * 0.5 / 2)
        and d.high == pytest.approx(0.25 + 0.49, abs=1e-4)
    )
    same = paired_difference([True, False] * 5, [True, False] * 5)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        paired_difference([True], [])


def test_identical_endpoints_pass() -> None:
    a, b = run("endpoint"), run("baseline")
    comparison = compare(a, b)
    assert comparison.agreement == 1.0 and comparison.strict_difference.value == 0.0
    verdict = Gate(tolerance=0.0, min_agreement=1.0).check([a, b], comparison)
    assert verdict.passed and verdict.exit_code == EXIT_OK and verdict.failures == ()


def test_difference_above_tolerance_fails() -> None:
    a, b = run("endpoint", wrong={0, 1}), run("baseline")  # 90% vs 100%
    comparison = compare(a, b)
    assert comparison.strict_difference.value == pytest.approx(-0.10)
    assert comparison.agreement == 0.9
    verdict = Gate(tolerance=0.05).check([a, b], comparison)
    assert verdict.exit_code == EXIT_GATE and "differs by -10.0 pts" in verdict.failures[0]
    assert Gate(tolerance=0.10).check([a, b], comparison).passed  # the tolerance is inclusive


def test_tolerance_boundary_and_sign() -> None:
    a, b = run("endpoint"), run("baseline", wrong={3})  # the endpoint is *better* by 1/20 = 0.05
    comparison = compare(a, b)
    assert comparison.strict_difference.value == pytest.approx(0.05)
    assert Gate(tolerance=0.05).check([a, b], comparison).passed
    assert Gate(tolerance=0.04).check([a, b], comparison).exit_code == EXIT_GATE  # |difference| counts both ways


def test_agreement_below_minimum_fails_even_with_equal_accuracy() -> None:
    a, b = run("endpoint"), run("baseline", suffix=" apples")  # same answers, different text
    comparison = compare(a, b)
    assert comparison.strict_difference.value == 0.0 and comparison.agreement == 0.0
    assert Gate(min_agreement=0.0).check([a, b], comparison).passed
    verdict = Gate(min_agreement=0.5).check([a, b], comparison)
    assert verdict.exit_code == EXIT_GATE and "agreement 0.0% is below the minimum 50.0%" in verdict.failures[0]


def test_request_errors_fail_and_win_over_the_gate() -> None:
    a, b = run("endpoint", failed={4}), run("baseline")
    assert a.errors == [(4, "HTTP 500: boom")]
    assert not a.scores[4].strict_correct and not a.scores[4].flexible_correct
    comparison = compare(a, b)
    assert not comparison.identical[4]
    assert Gate(tolerance=1.0).check([a, b], comparison).exit_code == EXIT_ERRORS
    verdict = Gate(tolerance=0.0).check([a, b], comparison)
    assert verdict.exit_code == EXIT_ERRORS and len(verdict.failures) == 2
    assert Gate().check([run("endpoint", failed={0})], None).exit_code == EXIT_ERRORS


def test_single_endpoint_has_no_gate() -> None:
    a = run("endpoint", wrong=set(range(15)))
    verdict = Gate(tolerance=0.0, min_agreement=1.0).check([a], None)
    assert verdict.passed
    text = format_report(INFO, [a], None, Gate(), verdict)
    assert "25.0%" in text and "endpoint - baseline" not in text and text.endswith("PASS")


def test_reports() -> None:
    a, b = run("endpoint", wrong={0, 1}, failed={2}), run("baseline")
    comparison, gate = compare(a, b), Gate()
    verdict = gate.check([a, b], comparison)
    text = format_report(INFO, [a, b], comparison, gate, verdict)
    assert "strict-match       85.0%  [64.0%, 94.8%]" in text and "strict-match      100.0%  [83.9%, 100.0%]" in text
    assert "strict-match      -15.0 pts  [-31.1, +1.1]   tolerance 5.0 pts: FAIL" in text
    assert "error x1: HTTP 500: boom" in text and "identical generations  17/20 (85.0%)" in text
    assert "FAIL" in text.splitlines()[-1]
    prompts = [f"Question: {p.question}\nAnswer:" for p in PROBLEMS]
    report = json.loads(json.dumps(json_report(INFO, PROBLEMS, prompts, [a, b], comparison, gate, verdict)))
    assert report["verdict"] == {"passed": False, "exit_code": EXIT_ERRORS, "failures": list(verdict.failures)}
    assert (
        report["endpoints"]["endpoint"]["errors"] == 1
        and report["endpoints"]["baseline"]["strict_match"]["value"] == 1.0
    )
    q0 = report["questions"][0]
    assert q0["prompt"] == prompts[0] and q0["target"] == "1" and q0["identical"] is False
    assert (
        q0["endpoint"]["strict_match"] == "2"
        and q0["endpoint"]["strict_correct"] is False
        and q0["baseline"]["strict_correct"] is True
    )
    assert (
        report["questions"][2]["endpoint"]["error"] == "HTTP 500: boom"
        and report["questions"][2]["endpoint"]["generation"] is None
    )


def test_base_url() -> None:
    for url in (
        "http://r:8000",
        "http://r:8000/",
        "http://r:8000/v1",
        "http://r:8000/v1/",
        "http://r:8000/v1/completions",
    ):
        assert base_url(url) == "http://r:8000"
    assert base_url("http://r:8000/prefix/v1") == "http://r:8000/prefix"


def test_progress_only_on_a_terminal() -> None:
    quiet = io.StringIO()  # not a TTY
    p = Progress("endpoint", 3, stream=quiet)
    for _ in range(3):
        p.advance()
    p.close()
    assert quiet.getvalue() == ""
    shown = io.StringIO()
    p = Progress("endpoint", 2, stream=shown, enabled=True)
    p.advance()
    p.advance(error=True)
    p.close()
    assert "\rendpoint [" in shown.getvalue() and "2/2" in shown.getvalue() and "errors 1" in shown.getvalue()
    assert shown.getvalue().endswith("\n")
