"""The simulator's multi-turn predictions against the measured multi-turn run (``python -m hybrid_pd.sizing.multiturn_check``).

Each row of ``hybrid_pd/bench/results/2026-11-26-h200x2-multiturn/summary.json`` (two GPUs as
colocated replicas, flexible workers or 1P1D, conversations through ``prefix_reuse`` routers with
prefix caching on) is simulated with the same conversations and concurrency, a salted row (every request a cache
salt of its own) as such (``Workload.salted``: no hit). The profile is of the same device and
settings, measured by ``hybrid-pd profile`` against a server with prefix caching on (one H200,
vLLM 0.26: Mamba cache mode ``all``, attention blocks of 1,152 tokens, on which every hit landed).
Before it, the check used the profile fitted on two H100s with caching off, at that block size.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from hybrid_pd.bench.stats import percentile
from hybrid_pd.sizing.layouts import RUNNER_SYSTEMS, Layout
from hybrid_pd.sizing.matrix import RESULTS
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.simulate import SLO, Outcome, simulate, summarize
from hybrid_pd.sizing.workload import Lengths, Workload

__all__ = ["compare", "main"]

RUN = RESULTS / "2026-11-26-h200x2-multiturn" / "summary.json"
PROFILE = RESULTS / "2026-11-26-h200x2-profiles" / "profile-on.json"
SLO_PAIR = "500/20"
FIGURES = ("throughput_req_s", "goodput_per_gpu", "ttft_first_turn_p50_ms", "ttft_later_turns_p50_ms", "tpot_mean_ms")


def _figures(outcomes: list[Outcome], layout: Layout) -> dict[str, float]:
    """What the multi-turn driver reports of a run (hybrid_pd.bench.multiturn.summarize), from simulated outcomes."""
    summary = summarize(layout, outcomes, SLO(*map(float, SLO_PAIR.split("/"))))
    return {
        "throughput_req_s": summary.throughput_rps,
        "goodput_per_gpu": summary.goodput_per_gpu,
        "ttft_first_turn_p50_ms": percentile([o.ttft_ms for o in outcomes if not o.request.earlier_prompt], 50),
        "ttft_later_turns_p50_ms": percentile([o.ttft_ms for o in outcomes if o.request.earlier_prompt], 50),
        "tpot_mean_ms": summary.tpot_mean_ms,
    }


def _measured(summary: dict[str, Any]) -> dict[str, float]:
    return {
        "throughput_req_s": summary["throughput_req_s"],
        "goodput_per_gpu": summary["goodput"][SLO_PAIR]["req_s_per_gpu"],
        "ttft_first_turn_p50_ms": summary["ttft_first_turn_ms"]["p50"],
        "ttft_later_turns_p50_ms": summary["ttft_later_turns_ms"]["p50"],
        "tpot_mean_ms": summary["tpot_mean_ms"],
    }


def _workload(row: dict[str, Any]) -> Workload:
    w = row["workload"]
    user, output = Lengths(*w["user_tokens"]), Lengths(w["output_tokens"], w["output_tokens"])
    return Workload(user, output, w["conversations"] * w["turns"], row["level"], None, w["seed"], w["turns"], w["system_tokens"], row["salted"])


def compare(profile: Profile, run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of ``run``: measured, predicted and (predicted - measured) / measured per figure."""
    rows = []
    for row in run["rows"]:
        layout = RUNNER_SYSTEMS[row["system"]]
        predicted = _figures(simulate(profile, layout, _workload(row)), layout)
        measured = _measured(row["summary"])
        error = {k: (predicted[k] - measured[k]) / measured[k] if measured[k] else None for k in FIGURES}
        rows.append({"system": row["system"], "level": row["level"], "salted": row["salted"], "measured": measured, "predicted": predicted,
                     "error": error, **({"label": row["label"]} if "label" in row else {})})  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["system", "conversations at once", "req/s", f"goodput {SLO_PAIR} /GPU", "TTFT p50 turn 1 ms", "TTFT p50 turns 2+ ms", "TPOT mean ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.get("label", r["system"]) + (" (salted: no hits)" if r["salted"] else ""), str(r["level"])]
        cells += [f"{r['measured'][k]:.2f} → {r['predicted'][k]:.2f} ({r['error'][k]:+.0%})" for k in FIGURES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_pd.sizing.multiturn_check", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--run", type=Path, default=RUN)
    parser.add_argument("--json", dest="json_out", type=Path, help="write the comparison")
    args = parser.parse_args(argv)
    profile = Profile.load(args.profile)
    rows = compare(profile, json.loads(args.run.read_text()))
    print(markdown(rows))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"profile": os.path.relpath(args.profile), "run": os.path.relpath(args.run), "block_tokens": profile.block_tokens,
                                             "mamba_cache_mode": profile.mamba_cache_mode, "rows": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
