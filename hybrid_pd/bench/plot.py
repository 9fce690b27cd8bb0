"""Latency against load as a PNG: TTFT, ITL and end-to-end latency, p50 (solid) and p99 (dashed), per target.

matplotlib is optional (the router's install does not need it): without it,
:func:`require_matplotlib` raises :class:`PlotUnavailable` with the install line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from hybrid_pd.bench.report import BenchReport
from hybrid_pd.bench.stats import Distribution

__all__ = ["Latencies", "PlotUnavailable", "plot_latency", "plot_series", "require_matplotlib"]

INSTALL_HINT = "pip install 'hybrid-pd[bench]'  (or: pip install matplotlib)"

_PANELS = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "end-to-end latency"))


class Latencies(Protocol):
    """What a point of a plotted series carries (a bench level's :class:`~hybrid_pd.bench.stats.Summary` does)."""

    ttft: Distribution | None
    itl: Distribution | None
    e2e: Distribution | None


class PlotUnavailable(RuntimeError):
    """--plot was asked for but matplotlib cannot be imported."""


def require_matplotlib() -> None:
    """Raise :class:`PlotUnavailable` unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from exc


def plot_latency(report: BenchReport, path: Path | str) -> None:
    """Draw the report's latencies against load into ``path`` (PNG)."""
    loads = [level.load for level in report.levels]
    series = {
        target.role: [(load.value, level.summary(target.role)) for load, level in zip(loads, report.levels, strict=True)]
        for target in report.targets
    }
    cfg = report.config
    title = f"{cfg.input_len} in / {cfg.output_len} out tokens, {cfg.num_prompts} prompts per level"
    plot_series(series, loads[0].kind if loads else "concurrency", title, path)


def plot_series(series: dict[str, list[tuple[float, Latencies | None]]], kind: str, title: str, path: Path | str) -> None:
    """Draw TTFT, ITL and end-to-end latency (p50 solid, p99 dashed) of each labelled series against load."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted({x for points in series.values() for x, _ in points})
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(5 * len(_PANELS), 4), squeeze=False)
    for ax, (field, panel) in zip(axes[0], _PANELS, strict=True):
        for i, (label, points) in enumerate(series.items()):
            color = f"C{i}"
            dists = [(x, None if summary is None else getattr(summary, field)) for x, summary in points]
            for pct, style in (("p50", "-"), ("p99", "--")):
                line = [(x, getattr(d, pct) * 1e3) for x, d in dists if d is not None and x != float("inf")]
                if line:
                    ax.plot(*zip(*line, strict=True), style, marker="o", color=color, label=f"{label} {pct}")
        ax.set_title(panel)
        ax.set_xlabel("concurrency" if kind == "concurrency" else "request rate (1/s)")
        ax.set_ylabel("ms")
        finite = [x for x in xs if x != float("inf")]
        if finite and min(finite) > 0 and max(finite) / min(finite) >= 8:
            ax.set_xscale("log", base=2)
            ax.set_xticks(finite, [f"{x:g}" for x in finite])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
