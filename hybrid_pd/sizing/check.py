"""The simulator's predictions against what the matrix measured, row by row (``python -m hybrid_pd.sizing.matrix check``).

Each replicas and fixed-split row is simulated with the same layout, traffic and SLO pair; a
figure of a row that a profile quantity was fitted to (:data:`hybrid_pd.sizing.matrix.FITS`) is
marked, so the table tells a fit from a prediction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hybrid_pd.sizing.matrix import SYSTEMS, Matrix, Measured, fitted
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.simulate import SLO, Prediction, predict

__all__ = ["METRICS", "Compared", "check", "markdown"]

METRICS = ("throughput_rps", "goodput_per_gpu", "ttft_p50_ms", "tpot_p50_ms", "tpot_mean_ms")


@dataclass(frozen=True)
class Compared:
    measured: Measured
    predicted: Prediction
    fitted: dict[str, str]  # metric -> the profile quantity fitted to it

    def error(self, metric: str) -> float | None:
        """(predicted - measured) / measured; None where nothing was measured."""
        m = getattr(self.measured, metric)
        return None if m == 0 else (getattr(self.predicted, metric) - m) / m

    def to_json(self) -> dict[str, Any]:
        return {"measured": asdict(self.measured), "predicted": self.predicted.to_json(), "fitted": self.fitted,
                "error": {m: self.error(m) for m in METRICS}}  # fmt: skip


def check(profile: Profile, matrix: Matrix) -> list[Compared]:
    return [Compared(r, predict(profile, SYSTEMS[r.system], r.workload(), matrix.slo), fitted(r.key)) for r in matrix.rows]


def markdown(compared: list[Compared], slo: SLO) -> str:
    """The comparison as a table, measured → predicted (error) per figure; a fitted figure in italics."""
    head = ["workload", "in flight", "system", "run", "req/s", f"goodput {slo} /GPU", "TTFT p50 ms", "TPOT p50 ms", "TPOT mean ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in sorted(compared, key=lambda c: (c.measured.input_len, c.measured.output_len, c.measured.level, c.measured.system, c.measured.run)):
        m = c.measured
        cells = [f"{m.input_len}/{m.output_len}", str(m.level), m.system, m.run.removeprefix("summary-")]
        for metric in METRICS:
            err = c.error(metric)
            text = f"{getattr(m, metric):.2f} → {getattr(c.predicted, metric):.2f} ({'n/a' if err is None else f'{err:+.0%}'})"
            cells.append(f"*{text}*" if metric in c.fitted else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
