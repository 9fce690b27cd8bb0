"""The hand-off budget: where a P/D request's time to first token goes, segment by segment.

From per-request timelines (:mod:`hybrid_pd.bench.timeline`) to one table per group of
requests (a ``hybrid-pd bench`` load level): median, p90 and mean of each segment, the
residual as a row of its own, and the router's TTFT they add up to. Means add up to the
mean TTFT (over the requests every row counts); medians and p90s of parts do not add up.

Also a command of its own, for a trace folder of any run::

    python -m hybrid_pd.bench.budget TRACE_DIR [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_pd.bench.stats import percentile
from hybrid_pd.bench.timeline import CHAINS, RESIDUAL, SEGMENTS, RequestTimeline, grouped, load_events, timelines

__all__ = ["Budget", "Row", "budget", "budgets", "format_budget", "main"]

TTFT_LABEL = "TTFT (router: arrival -> first byte to the client)"


@dataclass(frozen=True)
class Row:
    """One segment over the requests that have it: seconds."""

    name: str
    label: str
    count: int
    p50: float
    p90: float
    mean: float

    @classmethod
    def of(cls, name: str, label: str, values: Sequence[float]) -> Row:
        if not values:
            return cls(name, label, 0, float("nan"), float("nan"), float("nan"))
        return cls(name, label, len(values), percentile(values, 50), percentile(values, 90), sum(values) / len(values))

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "count": self.count, **{f"{k}_ms": _ms(getattr(self, k)) for k in ("p50", "p90", "mean")}}


@dataclass(frozen=True)
class Budget:
    """The budget of one group of requests: its segments (residual last), TTFT, and the requests behind it."""

    group: str
    rows: tuple[Row, ...]
    ttft: Row
    requests: tuple[RequestTimeline, ...]
    repeated: int  # left out: their legs were sent more than once

    @property
    def complete(self) -> int:
        return sum(t.complete for t in self.requests)

    def to_json(self, requests: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "group": self.group,
            "requests": len(self.requests),
            "complete": self.complete,
            "repeated": self.repeated,
            "segments": {row.name: row.to_json() for row in self.rows},
            "ttft": self.ttft.to_json(),
        }
        if requests:
            out["per_request"] = [t.to_json() for t in self.requests]
        return out


def budget(group: str, found: Sequence[RequestTimeline]) -> Budget:
    """The budget of ``found`` (requests whose legs were sent twice are counted, not used)."""
    used = tuple(t for t in found if not t.repeated)
    # A group of one chain has its rows; a mixed one the sequential legs' rows, the others' values where they share them.
    kinds = {t.chain for t in used}
    chain = CHAINS[kinds.pop()] if len(kinds) == 1 else SEGMENTS
    rows = [Row.of(s.name, s.label, [v for t in used if (v := t.segments.get(s.name)) is not None]) for s in chain]
    rows.append(Row.of(RESIDUAL.name, RESIDUAL.label, [t.residual_s for t in used]))
    return Budget(group, tuple(rows), Row.of("ttft", TTFT_LABEL, [t.ttft_s for t in used]), used, len(found) - len(used))


def budgets(directory: str | Path, prefix: str = "") -> list[Budget]:
    """One budget per request group (:func:`~hybrid_pd.bench.timeline.request_group`) of the trace in ``directory``, ids starting with ``prefix``."""
    found = [t for t in timelines(load_events(directory)) if t.rid.startswith(prefix)]
    return [budget(group, members) for group, members in grouped(found).items()]


def format_budget(b: Budget, title: str | None = None) -> str:
    """``b`` as a text table: one line per segment, the residual, then TTFT."""
    width = max(len(r.label) for r in (*b.rows, b.ttft))
    head = f"{title or b.group}: {len(b.requests)} requests, {b.complete} with every segment, {b.repeated} left out (legs sent twice)"
    lines = [head, f"{'segment':<{width}}  {'p50 ms':>9}  {'p90 ms':>9}  {'mean ms':>9}  {'n':>5}"]
    for row in (*b.rows, b.ttft):
        if row is b.ttft:
            lines.append("-" * (width + 41))
        lines.append(f"{row.label:<{width}}  {_cell(row.p50)}  {_cell(row.p90)}  {_cell(row.mean)}  {row.count:>5}")
    lines.append("means add up to the mean TTFT; medians and p90s of parts do not add up.")
    return "\n".join(lines)


def _cell(seconds: float) -> str:
    return f"{'-':>9}" if seconds != seconds else f"{seconds * 1e3:9.3f}"


def _ms(seconds: float) -> float | None:
    return None if seconds != seconds else round(seconds * 1e3, 4)


def main(argv: list[str] | None = None) -> int:
    """``python -m hybrid_pd.bench.budget TRACE_DIR``: print every group's budget; ``--json``: write them."""
    parser = argparse.ArgumentParser(prog="python -m hybrid_pd.bench.budget", description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", type=Path, help="the folder given to --timeline-dir of the router and the workers")
    parser.add_argument("--prefix", default="", help="only requests whose id starts with this")
    parser.add_argument("--json", dest="json_out", type=Path, help="write the budgets and every request's segments here")
    args = parser.parse_args(argv)
    if not args.trace_dir.is_dir():
        print(f"{args.trace_dir}: no such folder (give the router's and workers' --timeline-dir)", file=sys.stderr)
        return 2
    found = budgets(args.trace_dir, args.prefix)
    if not found:
        print(f"{args.trace_dir}: no request the router answered as a stream is traced there", file=sys.stderr)
        return 3
    print("\n\n".join(format_budget(b) for b in found))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps([b.to_json() for b in found], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
