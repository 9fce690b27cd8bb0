"""What a benchmark found: one summary per (load level, target), as a text table and as JSON.

Exit codes (as ``hybrid-pd eval``): 0 every request completed; 2 bad usage; 3 some
requests failed (the report is still printed and written) or a target could not be used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hybrid_pd.bench.runner import Load, Target, TargetRun
from hybrid_pd.bench.stats import SLO, Distribution, Summary, summarize

__all__ = ["EXIT_ERRORS", "EXIT_OK", "EXIT_USAGE", "BenchConfig", "BenchReport", "Level", "build_report", "format_table"]

EXIT_OK, EXIT_USAGE, EXIT_ERRORS = 0, 2, 3


@dataclass(frozen=True)
class BenchConfig:
    """How the run was made (the same for every target)."""

    input_len: int
    output_len: int
    num_prompts: int
    seed: int
    vocab_size: int
    warmup: int
    slo: SLO
    stream: bool = True

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["slo"] = self.slo.to_json_ms()
        return out


@dataclass(frozen=True)
class Level:
    """One load level: each target's summary, in target order, and its requests."""

    load: Load
    runs: tuple[TargetRun, ...]
    summaries: tuple[Summary, ...]

    def summary(self, role: str) -> Summary | None:
        for run, summary in zip(self.runs, self.summaries, strict=True):
            if run.target.role == role:
                return summary
        return None


@dataclass(frozen=True)
class BenchReport:
    """The whole run: configuration, targets, and one :class:`Level` per load."""

    config: BenchConfig
    targets: tuple[Target, ...]
    levels: tuple[Level, ...]

    @property
    def errors(self) -> int:
        return sum(s.errors for level in self.levels for s in level.summaries)

    @property
    def exit_code(self) -> int:
        return EXIT_ERRORS if self.errors else EXIT_OK

    def to_json(self, requests: bool = True) -> dict[str, Any]:
        """The JSON report; ``requests``: with every request's timings (ms) too."""
        levels = []
        for level in self.levels:
            entry: dict[str, Any] = {"load": level.load.to_json()}
            for run, summary in zip(level.runs, level.summaries, strict=True):
                entry[run.target.role] = summary.to_json()
                if requests:
                    entry[run.target.role]["per_request"] = [_request_json(r) for r in run.results]
            levels.append(entry)
        return {
            "config": self.config.to_json(),
            "targets": {t.role: {"url": t.url, "model": t.model} for t in self.targets},
            "levels": levels,
            "errors": self.errors,
        }


def build_report(config: BenchConfig, targets: Sequence[Target], runs: Sequence[Sequence[TargetRun]]) -> BenchReport:
    """Summarize ``runs[level][target]`` into a report."""
    levels = []
    for level_runs in runs:
        summaries = tuple(
            summarize(run.results, run.duration_s, config.slo, config.input_len, config.output_len) for run in level_runs
        )
        levels.append(Level(level_runs[0].load, tuple(level_runs), summaries))
    return BenchReport(config, tuple(targets), tuple(levels))


def _request_json(r: Any) -> dict[str, Any]:
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1e3, 3)

    out: dict[str, Any] = {"e2e_ms": ms(r.e2e_s), "ttft_ms": ms(r.ttft_s), "output_tokens": r.output_tokens}
    if r.error is not None:
        out["error"] = r.error
    return out


_COLUMNS = (
    ("load", 10, "<"),
    ("target", 8, "<"),
    ("ok", 5, ">"),
    ("err", 4, ">"),
    ("req/s", 7, ">"),
    ("out tok/s", 9, ">"),
    ("TTFT p50/p90/p99 ms", 23, ">"),
    ("ITL p50/p90/p99 ms", 23, ">"),
    ("E2E p50/p90/p99 ms", 23, ">"),
    ("goodput", 8, ">"),
)


def format_table(report: BenchReport) -> str:
    """The human-readable report (what ``hybrid-pd bench`` prints on stdout)."""
    cfg = report.config
    out = [
        f"{cfg.num_prompts} prompts x {cfg.input_len} random token ids (vocab {cfg.vocab_size}, seed {cfg.seed}), "
        f"{cfg.output_len} output tokens each (ignore_eos), {'streamed' if cfg.stream else 'JSON answers'}",
    ]
    for target in report.targets:
        out.append(f"{target.role:<9} {target.url}  model {target.model!r}")
    if cfg.slo.given:
        slo = cfg.slo.to_json_ms()
        parts = [f"{k[:-3].upper()} <= {v:g} ms" for k, v in slo.items() if v is not None]
        out.append("goodput: requests/s with " + " and ".join(parts) + " (ITL: the request's mean, i.e. TPOT)")
    out.append("")
    out.append("  ".join(f"{name:{align}{width}}" for name, width, align in _COLUMNS))
    for level in report.levels:
        for run, s in zip(level.runs, level.summaries, strict=True):
            cells = (
                level.load.label,
                run.target.role,
                str(s.completed),
                str(s.errors),
                f"{s.request_throughput:.2f}",
                f"{s.output_throughput:.1f}",
                _triple(s.ttft),
                _triple(s.itl),
                _triple(s.e2e),
                "-" if s.goodput is None else f"{s.goodput:.2f}",
            )
            out.append("  ".join(f"{c:{align}{width}}" for c, (_, width, align) in zip(cells, _COLUMNS, strict=True)))
    notes = _notes(report)
    if notes:
        out.append("")
        out.extend(notes)
    return "\n".join(out)


def _triple(d: Distribution | None) -> str:
    if d is None:
        return "-"
    return "/".join(_ms(v) for v in (d.p50, d.p90, d.p99))


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _notes(report: BenchReport) -> list[str]:
    """Errors and anything that makes the figures less than they look."""
    notes = []
    for level in report.levels:
        for run, s in zip(level.runs, level.summaries, strict=True):
            where = f"{run.target.role} {level.load.label}"
            for error, count in s.error_samples:
                notes.append(f"{where}: error x{count}: {error}")
            if s.length_mismatches:
                notes.append(
                    f"{where}: {s.length_mismatches} answers were not {report.config.output_len} tokens long "
                    "(does the server honour ignore_eos?)"
                )
            if s.usage_missing:
                notes.append(f"{where}: {s.usage_missing} streams had no usage; their tokens were counted from events")
    return notes
