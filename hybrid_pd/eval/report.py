"""What an evaluation found: per-endpoint accuracy, the comparison, the pass/fail gate, the reports.

Exit codes: 0 passed; 1 the comparison gate failed (accuracy difference above the
tolerance, or agreement below the minimum); 2 bad usage (argparse's code too);
3 requests failed (which makes the accuracies unreliable, so it wins over 1).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_pd.eval.client import Generation
from hybrid_pd.eval.data import Problem
from hybrid_pd.eval.scoring import INVALID, Score, score
from hybrid_pd.eval.stats import Interval, paired_difference, wilson

__all__ = [
    "EXIT_ERRORS",
    "EXIT_GATE",
    "EXIT_OK",
    "EXIT_USAGE",
    "Comparison",
    "EndpointRun",
    "EndpointSummary",
    "Gate",
    "RunInfo",
    "Verdict",
    "compare",
    "format_report",
    "json_report",
    "write_json",
]

EXIT_OK, EXIT_GATE, EXIT_USAGE, EXIT_ERRORS = 0, 1, 2, 3

_FAILED = Score(INVALID, INVALID, False, False)  # a failed request answers nothing, so nothing right
_SHOWN_ERRORS = 5


@dataclass(frozen=True)
class RunInfo:
    """How the questions were asked (the same for every endpoint)."""

    task: str
    dataset: str
    shots: int
    max_tokens: int
    stop: tuple[str, ...]
    seed: int | None = None


@dataclass(frozen=True)
class EndpointRun:
    """One endpoint's generations for every question, and their scores."""

    role: str  # "endpoint" or "baseline"
    url: str
    model: str
    generations: tuple[Generation, ...]
    scores: tuple[Score, ...]
    wall_s: float

    @classmethod
    def scored(
        cls,
        role: str,
        url: str,
        model: str,
        problems: Sequence[Problem],
        generations: Sequence[Generation],
        wall_s: float,
    ) -> EndpointRun:
        """Score ``generations`` against ``problems`` (a failed request scores wrong on both filters)."""
        if len(problems) != len(generations):
            raise ValueError(f"{len(generations)} generations for {len(problems)} problems")
        scores = tuple(
            score(g.text, p.answer) if g.text is not None else _FAILED
            for p, g in zip(problems, generations, strict=True)
        )
        return cls(role, url, model, tuple(generations), scores, wall_s)

    @property
    def strict_correct(self) -> list[bool]:
        return [s.strict_correct for s in self.scores]

    @property
    def flexible_correct(self) -> list[bool]:
        return [s.flexible_correct for s in self.scores]

    @property
    def errors(self) -> list[tuple[int, str]]:
        """``(question index, error)`` for every failed request."""
        return [(i, g.error) for i, g in enumerate(self.generations) if g.error is not None]

    def summary(self) -> EndpointSummary:
        n = len(self.scores)
        return EndpointSummary(
            role=self.role,
            url=self.url,
            model=self.model,
            questions=n,
            errors=len(self.errors),
            strict=wilson(sum(self.strict_correct), n),
            flexible=wilson(sum(self.flexible_correct), n),
            wall_s=self.wall_s,
        )


@dataclass(frozen=True)
class EndpointSummary:
    """Accuracy of one endpoint on both filters, with Wilson 95% intervals."""

    role: str
    url: str
    model: str
    questions: int
    errors: int
    strict: Interval
    flexible: Interval
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "questions": self.questions,
            "errors": self.errors,
            "strict_match": self.strict.to_json(),
            "flexible_extract": self.flexible.to_json(),
            "wall_s": round(self.wall_s, 3),
        }


@dataclass(frozen=True)
class Comparison:
    """Endpoint minus baseline on the same questions, and how often they answered identically."""

    strict_difference: Interval
    flexible_difference: Interval
    identical: tuple[bool, ...]

    @property
    def agreement(self) -> float:
        """The fraction of questions whose two generations are the same text (a failure never is)."""
        return sum(self.identical) / len(self.identical) if self.identical else 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "strict_match_difference": self.strict_difference.to_json(),
            "flexible_extract_difference": self.flexible_difference.to_json(),
            "identical": sum(self.identical),
            "questions": len(self.identical),
            "agreement": self.agreement,
        }


def compare(endpoint: EndpointRun, baseline: EndpointRun) -> Comparison:
    """Compare two runs over the same questions, question by question."""
    identical = tuple(
        a.text is not None and a.text == b.text for a, b in zip(endpoint.generations, baseline.generations, strict=True)
    )
    return Comparison(
        strict_difference=paired_difference(endpoint.strict_correct, baseline.strict_correct),
        flexible_difference=paired_difference(endpoint.flexible_correct, baseline.flexible_correct),
        identical=identical,
    )


@dataclass(frozen=True)
class Verdict:
    """Whether the evaluation passed, why not, and the exit code that says so."""

    failures: tuple[str, ...] = ()
    exit_code: int = EXIT_OK

    @property
    def passed(self) -> bool:
        return self.exit_code == EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "exit_code": self.exit_code, "failures": list(self.failures)}


@dataclass(frozen=True)
class Gate:
    """The pass/fail rule: no request errors, |strict-match difference| <= tolerance, agreement >= minimum.

    The difference is on ``strict-match`` accuracy, the filter vLLM's own NIXL accuracy
    test checks, and 0.05 is that test's tolerance (absolute, in accuracy units).
    """

    tolerance: float = 0.05
    min_agreement: float = 0.0

    def check(self, runs: Sequence[EndpointRun], comparison: Comparison | None) -> Verdict:
        failures: list[str] = []
        exit_code = EXIT_OK
        if comparison is not None:
            difference = comparison.strict_difference.value
            if abs(difference) > self.tolerance + 1e-12:
                failures.append(
                    f"strict-match accuracy differs by {_pts(difference)}, "
                    f"more than the tolerance {_pts(self.tolerance, sign=False)}"
                )
                exit_code = EXIT_GATE
            if comparison.agreement < self.min_agreement - 1e-12:
                failures.append(f"agreement {comparison.agreement:.1%} is below the minimum {self.min_agreement:.1%}")
                exit_code = EXIT_GATE
        for run in runs:
            if run.errors:
                failures.append(f"{len(run.errors)} of {len(run.generations)} requests to the {run.role} failed")
                exit_code = EXIT_ERRORS
        return Verdict(tuple(failures), exit_code)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _pts(x: float, sign: bool = True) -> str:
    """An accuracy difference in percentage points."""
    return f"{100 * x:+.1f} pts" if sign else f"{100 * x:.1f} pts"


def _interval(i: Interval) -> str:
    return f"{_pct(i.value):>6}  [{_pct(i.low)}, {_pct(i.high)}]"


def _difference(i: Interval) -> str:
    return f"{100 * i.value:+.1f} pts  [{100 * i.low:+.1f}, {100 * i.high:+.1f}]"


def format_report(
    info: RunInfo, runs: Sequence[EndpointRun], comparison: Comparison | None, gate: Gate, verdict: Verdict
) -> str:
    """The human-readable report (what ``hybrid-pd eval`` prints on stdout)."""
    out: list[str] = []
    n = len(runs[0].generations) if runs else 0
    out.append(f"{info.task} ({info.dataset}): {n} questions, {info.shots}-shot, greedy, max_tokens {info.max_tokens}")
    out.append("accuracy with Wilson 95% intervals; differences with paired normal-approximation 95% intervals")
    for run in runs:
        s = run.summary()
        out.append("")
        out.append(
            f"{run.role:<9} {run.url}  model {run.model!r}  "
            f"{s.questions} questions, {s.errors} errors, {s.wall_s:.1f} s"
        )
        out.append(f"  strict-match      {_interval(s.strict)}")
        out.append(f"  flexible-extract  {_interval(s.flexible)}")
        for error, count in Counter(e for _, e in run.errors).most_common(_SHOWN_ERRORS):
            out.append(f"  error x{count}: {error}")
    if comparison is not None:
        difference = comparison.strict_difference.value
        within = abs(difference) <= gate.tolerance + 1e-12
        agree = comparison.agreement >= gate.min_agreement - 1e-12
        out.append("")
        out.append("endpoint - baseline")
        out.append(
            f"  strict-match      {_difference(comparison.strict_difference)}"
            f"   tolerance {_pts(gate.tolerance, sign=False)}: {'ok' if within else 'FAIL'}"
        )
        out.append(f"  flexible-extract  {_difference(comparison.flexible_difference)}")
        out.append(
            f"  identical generations  {sum(comparison.identical)}/{len(comparison.identical)}"
            f" ({_pct(comparison.agreement)})"
            f"   minimum {_pct(gate.min_agreement)}: {'ok' if agree else 'FAIL'}"
        )
    out.append("")
    out.append("PASS" if verdict.passed else "FAIL: " + "; ".join(verdict.failures))
    return "\n".join(out)


def json_report(
    info: RunInfo,
    problems: Sequence[Problem],
    prompts: Sequence[str],
    runs: Sequence[EndpointRun],
    comparison: Comparison | None,
    gate: Gate,
    verdict: Verdict,
) -> dict[str, Any]:
    """Everything, question by question: prompt, each endpoint's generation, extractions, correctness."""
    questions = []
    for i, (problem, prompt) in enumerate(zip(problems, prompts, strict=True)):
        entry: dict[str, Any] = {
            "index": i,
            "question": problem.question,
            "reference": problem.answer,
            "target": problem.target,
            "prompt": prompt,
        }
        for run in runs:
            g, s = run.generations[i], run.scores[i]
            entry[run.role] = {
                "generation": g.text,
                "error": g.error,
                "finish_reason": g.finish_reason,
                "completion_tokens": g.completion_tokens,
                "latency_s": round(g.latency_s, 4),
                "strict_match": s.strict,
                "flexible_extract": s.flexible,
                "strict_correct": s.strict_correct,
                "flexible_correct": s.flexible_correct,
            }
        if comparison is not None:
            entry["identical"] = comparison.identical[i]
        questions.append(entry)
    return {
        "task": info.task,
        "dataset": info.dataset,
        "shots": info.shots,
        "max_tokens": info.max_tokens,
        "stop": list(info.stop),
        "seed": info.seed,
        "intervals": {"accuracy": "wilson-95", "difference": "paired-normal-95"},
        "gate": {"tolerance": gate.tolerance, "min_agreement": gate.min_agreement, "metric": "strict-match"},
        "endpoints": {run.role: run.summary().to_json() for run in runs},
        "comparison": comparison.to_json() if comparison is not None else None,
        "verdict": verdict.to_json(),
        "questions": questions,
    }


def write_json(report: dict[str, Any], path: Path | str) -> None:
    """Write the JSON report to ``path``, creating its folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
