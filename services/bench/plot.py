"""Latency against load as a PNG: TTFT, ITL and end-to-end latency, p50 (solid) and p99 (dashed), per target.

matplotlib is optional (the router's install does not need it): without it,
:func:`require_matplotlib` raises :class:`PlotUnavailable` with the install line.
"""

from __future__ import annotations

from pathlib import Path

from services.bench.report import BenchReport
from services.bench.stats import Distribution

__all__ = ["PlotUnavailable", "plot_latency", "require_matplotlib"]

INSTALL_HINT = "pip install 'hybrid-pd[bench]'  (or: pip install matplotlib)"

_PANELS = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "end-to-end latency"))


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
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [level.load for level in report.levels]
    xs = [load.value for load in loads]
    kind = loads[0].kind if loads else "concurrency"
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(5 * len(_PANELS), 4), squeeze=False)
    for ax, (field, title) in zip(axes[0], _PANELS, strict=True):
        for i, target in enumerate(report.targets):
            color = f"C{i}"
            dists: list[Distribution | None] = []
            for level in report.levels:
                summary = level.summary(target.role)
                dists.append(None if summary is None else getattr(summary, field))
            for pct, style in (("p50", "-"), ("p99", "--")):
                points = [(x, getattr(d, pct) * 1e3) for x, d in zip(xs, dists, strict=True) if d is not None and x != float("inf")]
                if points:
                    ax.plot(*zip(*points, strict=True), style, marker="o", color=color, label=f"{target.role} {pct}")
        ax.set_title(title)
        ax.set_xlabel("concurrency" if kind == "concurrency" else "request rate (1/s)")
        ax.set_ylabel("ms")
        finite = [x for x in xs if x != float("inf")]
        if finite and min(finite) > 0 and max(finite) / min(finite) >= 8:
            ax.set_xscale("log", base=2)
            ax.set_xticks(finite, [f"{x:g}" for x in finite])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    cfg = report.config
    fig.suptitle(f"{cfg.input_len} in / {cfg.output_len} out tokens, {cfg.num_prompts} prompts per level")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
