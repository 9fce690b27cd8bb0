"""The matrix's workloads projected to 8, 16 and 64 GPUs: every layout simulated, the best per SLO pair (docs/sizing.md).

The traffic keeps the load per GPU of the matrix's busiest level (64 in flight on two GPUs): 32
requests in flight per GPU, closed loop, ``vllm bench serve``'s default count of five waves. Each
cell is exactly ``hybrid-pd size`` with the command :func:`command` prints; the two SLO pairs share
one simulation per layout (the SLOs only count its requests). Layouts run in parallel processes
(``--jobs``, as ``hybrid-pd size --jobs``).

    python -m hybrid_pd.sizing.projection --profile PROFILE.json --json OUT.json   # prints the markdown of docs/sizing.md
    python -m hybrid_pd.sizing.projection --from OUT.json                          # the markdown again, without simulating
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybrid_pd.sizing.layouts import Layout, layouts
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.simulate import SLO, Prediction, predict_many
from hybrid_pd.sizing.workload import Lengths, Workload, default_prompts

__all__ = ["GPUS", "IN_FLIGHT_PER_GPU", "SLOS", "WORKLOADS", "cell", "command", "commands", "markdown", "project", "workload"]

WORKLOADS = ((3000, 128), (1000, 64), (1000, 512), (200, 1000))
SLOS = (SLO(500, 20), SLO(1500, 50))
GPUS = (8, 16, 64)
IN_FLIGHT_PER_GPU = 32


def workload(gpus: int, input_len: int, output_len: int) -> Workload:
    concurrency = IN_FLIGHT_PER_GPU * gpus
    return Workload(Lengths(input_len, input_len), Lengths(output_len, output_len), default_prompts(concurrency, None), concurrency)


def command(profile_path: str, gpus: int, input_len: int, output_len: int, slo: SLO) -> str:
    """The ``hybrid-pd size`` command that prints the same predictions for one cell."""
    return (f"hybrid-pd size --profile {profile_path} --gpus {gpus} --input-len {input_len} --output-len {output_len} "
            f"--concurrency {IN_FLIGHT_PER_GPU * gpus} --slo-ttft-ms {slo.ttft_ms:g} --slo-tpot-ms {slo.tpot_ms:g}")  # fmt: skip


KEPT = ("layout", "kind", "prefill", "decode", "gpus", "throughput_rps", "goodput_per_gpu", "slo_met", "ttft_p50_ms", "tpot_p50_ms", "tpot_mean_ms")


def _kept(p: Prediction) -> dict[str, Any]:
    """What the projection keeps of a prediction (``hybrid-pd size --json`` has all), figures to 4 decimals: 1,560 of them."""
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in p.to_json().items() if k in KEPT}


def cell(profile: Profile, layout: Layout, gpus: int, input_len: int, output_len: int) -> list[dict[str, Any]]:
    """One layout under one cell's traffic, summarized for each SLO pair."""
    (per_slo,) = predict_many(profile, [(layout, workload(gpus, input_len, output_len))], list(SLOS))
    return [_kept(p) for p in per_slo]


def project(profile: Profile, gpus: tuple[int, ...] = GPUS, workloads: tuple[tuple[int, int], ...] = WORKLOADS, jobs: int = 2) -> list[dict[str, Any]]:
    """Every layout of every cell: ``[{gpus, input_len, output_len, slo_ms, predictions}]``."""
    keys = [(g, i, o) for g in gpus for i, o in workloads]
    tasks = [(layout, workload(g, i, o)) for g, i, o in keys for layout in layouts(g)]
    done = iter(predict_many(profile, tasks, list(SLOS), jobs))
    cells = []
    for g, i, o in keys:
        per_layout = [next(done) for _ in layouts(g)]
        cells += [{"gpus": g, "input_len": i, "output_len": o, "slo_ms": str(slo), "predictions": [_kept(p[k]) for p in per_layout]}
                  for k, slo in enumerate(SLOS)]  # fmt: skip
    return cells


def _best(predictions: list[dict[str, Any]], kind: str | None = None) -> dict[str, Any]:
    """The most goodput per GPU (the first of equals: replicas before a split), of one kind or of all."""
    candidates = [p for p in predictions if kind is None or p["kind"] == kind]
    return max(candidates, key=lambda p: (p["goodput_per_gpu"], -candidates.index(p)))


def markdown(cells: list[dict[str, Any]]) -> str:
    """One row per workload, GPU count and SLO pair: the best layout, its figures, and the replicas' and best split's goodput."""
    head = ["workload", "GPUs", "in flight", "SLO ms", "best layout", "goodput /GPU", "req/s", "TTFT p50 ms", "TPOT p50 ms",
            "replicas goodput /GPU", "best xPyD", "its goodput /GPU"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {w: k for k, w in enumerate(WORKLOADS)}
    for c in sorted(cells, key=lambda c: (order.get((c["input_len"], c["output_len"]), 99), c["slo_ms"] != str(SLOS[0]), c["gpus"])):
        b, r, s = _best(c["predictions"]), _best(c["predictions"], "replicas"), _best(c["predictions"], "pd")
        lines.append("| " + " | ".join([
            f"{c['input_len']}/{c['output_len']}", str(c["gpus"]), str(IN_FLIGHT_PER_GPU * c["gpus"]), c["slo_ms"], f"**{b['layout']}**",
            f"{b['goodput_per_gpu']:.2f}", f"{b['throughput_rps']:.1f}", f"{b['ttft_p50_ms']:.0f}", f"{b['tpot_p50_ms']:.1f}",
            f"{r['goodput_per_gpu']:.2f}", s["layout"], f"{s['goodput_per_gpu']:.2f}",
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


def commands(profile_path: str) -> str:
    """The ``hybrid-pd size`` command of every row of :func:`markdown`, in its order."""
    return "\n".join(command(profile_path, g, i, o, slo) for i, o in WORKLOADS for slo in SLOS for g in GPUS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_pd.sizing.projection", description=__doc__.splitlines()[0])
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", type=Path, help="simulate every cell from this profile")
    source.add_argument("--from", dest="from_json", type=Path, help="print the markdown of a projection written before")
    ap.add_argument("--json", type=Path, help="write every prediction here")
    ap.add_argument("--gpus", default=",".join(map(str, GPUS)), help="GPU counts (default 8,16,64)")
    ap.add_argument("--jobs", type=int, default=2, help="processes simulating layouts at once")
    args = ap.parse_args(argv)
    if args.from_json:
        written = json.loads(args.from_json.read_text())
        print(markdown(written["cells"]) + "\n\n" + commands(written["profile"]))
        return 0
    cells = project(Profile.load(args.profile), tuple(int(g) for g in args.gpus.split(",")), jobs=args.jobs)
    if args.json:
        head = json.dumps({"profile": str(args.profile), "in_flight_per_gpu": IN_FLIGHT_PER_GPU})[:-1]
        args.json.write_text(head + ', "cells": [\n' + ",\n".join(json.dumps(c) for c in cells) + "\n]}\n")  # a cell a line
    print(markdown(cells) + "\n\n" + commands(str(args.profile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
