"""What ``hybrid-pd size`` shows of its predictions: a table, JSON, and goodput per GPU against GPUs.

The best layout of a GPU count is the one with the most goodput per GPU (the first of equals,
in :func:`~hybrid_pd.sizing.layouts.layouts`' order: replicas before any split).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.simulate import SLO, Prediction
from hybrid_pd.sizing.workload import Workload

__all__ = ["best", "format_phases", "format_table", "plot_goodput", "to_json"]

_COLUMNS = ("GPUs", "layout", "req/s", "goodput req/s", "goodput /GPU", "within SLO", "TTFT p50", "TPOT p50", "TPOT mean")


def best(predictions: list[Prediction]) -> dict[int, Prediction]:
    """The best layout of each GPU count."""
    out: dict[int, Prediction] = {}
    for p in predictions:
        if p.gpus not in out or p.goodput_per_gpu > out[p.gpus].goodput_per_gpu:
            out[p.gpus] = p
    return out


def format_table(predictions: list[Prediction], workload: Workload, slo: SLO) -> str:
    """One row per layout, the best of each GPU count marked ``*``."""
    winners = {id(p) for p in best(predictions).values()}
    rows = [
        (str(p.gpus), p.layout + (" *" if id(p) in winners else ""), f"{p.throughput_rps:.2f}", f"{p.goodput_rps:.2f}",
         f"{p.goodput_per_gpu:.2f}", f"{p.slo_met:.0%}", f"{p.ttft_p50_ms:.0f}", f"{p.tpot_p50_ms:.1f}", f"{p.tpot_mean_ms:.1f}")
        for p in predictions
    ]  # fmt: skip
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    lines = [
        f"{workload.input_len} in / {workload.output_len} out tokens, {workload.load}, {workload.num_prompts} requests; "
        f"goodput: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms; every figure is simulated",
        "  ".join(c.rjust(w) for c, w in zip(_COLUMNS, widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def format_phases(predictions: list[Prediction], each: list[list[Prediction]], changes: list, phases: list[Workload], slo: SLO) -> str:
    """The planner's run against the fixed layouts under one phase-shifting traffic (its first row), whole and phase by phase
    (``each``), then the planner's moves. A phase is judged by the SLO its requests ask for, else ``slo``."""
    columns = ("phase", "SLO", "layout", "req/s", "goodput /GPU", "vs replicas", "within SLO", "TTFT p50", "TPOT p50")

    def rows(label: str, targets: str, figures: list[Prediction]) -> list[tuple[str, ...]]:
        replicas = next((p.goodput_per_gpu for p in figures if p.kind == "replicas"), 0.0)
        return [
            (label, targets, p.layout, f"{p.throughput_rps:.2f}", f"{p.goodput_per_gpu:.2f}",
             f"{p.goodput_per_gpu / replicas:.2f}x" if replicas else "-", f"{p.slo_met:.0%}", f"{p.ttft_p50_ms:.0f}", f"{p.tpot_p50_ms:.1f}")
            for p in figures
        ]  # fmt: skip

    table = [r for i, (phase, figures) in enumerate(zip(phases, each, strict=True)) for r in rows(str(i + 1), str(phase.slo or slo), figures)]
    table += rows("all", ", ".join(dict.fromkeys(str(phase.slo or slo) for phase in phases)), predictions)
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(columns)]
    named = ",".join(f"{p.input_len}/{p.output_len}@{p.concurrency}x{p.num_prompts}" for p in phases)
    lines = [f"phases {named}, one after the other; goodput: each request within its phase's SLO; every figure is simulated",
             "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]  # fmt: skip
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    lines += [f"planner moves: {len(changes)}"] + [f"  at {c.at_s:.1f} s: {c.why}" for c in changes]
    return "\n".join(lines)


def to_json(profiles: list[Profile], workload: Workload, slo: SLO, predictions: list[Prediction]) -> dict[str, Any]:
    """Everything the predictions rest on (the whole profiles too, one per worker size) and the predictions."""
    return {
        "profiles": [profile.model_dump(mode="json") for profile in profiles],
        "workload": {"input_len": str(workload.input_len), "output_len": str(workload.output_len), "num_prompts": workload.num_prompts,
                     "concurrency": workload.concurrency, "rate": workload.rate, "seed": workload.seed, "turns": workload.turns,
                     "system_len": workload.system_len},
        "slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms},
        "predictions": [p.to_json() for p in predictions],
        "best": {str(g): p.layout for g, p in best(predictions).items()},
    }  # fmt: skip


def plot_goodput(predictions: list[Prediction], title: str, path: Path) -> None:
    """Goodput per GPU against GPUs: replicas, flexible workers and the best xPyD split of each count (labelled)."""
    from hybrid_pd.bench.plot import require_matplotlib

    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, label in (("replicas", "replicas"), ("flex", "flexible workers"), ("pd", "best xPyD")):
        points = best([p for p in predictions if p.kind == kind])
        if not points:
            continue
        xs = sorted(points)
        ax.plot(xs, [points[g].goodput_per_gpu for g in xs], marker="o", label=label, linestyle="--" if kind == "flex" else "-")
        if kind == "pd":
            for g in xs:
                ax.annotate(points[g].layout, (g, points[g].goodput_per_gpu), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.set_title(title, fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
