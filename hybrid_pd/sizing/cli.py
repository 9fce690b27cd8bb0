"""``hybrid-pd size``: the layouts of some GPUs under a traffic, predicted from a profile by simulation.

Wired into ``hybrid-pd`` by :func:`add_size_parser` and :func:`run_size`. This module reads the
arguments and puts the pieces together: profile + workload + SLO pair + GPU counts -> every
layout simulated (:func:`hybrid_pd.sizing.simulate.size`) -> table (and ``--json``, ``--plot``).
Bad input is answered on one line naming the flag, exit code 2, before anything is simulated.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from hybrid_pd.common import checks
from hybrid_pd.common.arg_types import at_least, checked
from hybrid_pd.sizing.profile import Profile, ProfileError, profile_path, profile_set
from hybrid_pd.sizing.workload import Lengths

__all__ = ["add_size_parser", "run_size"]


def _profile(text: str) -> Profile:
    try:
        return Profile.load(profile_path(text))
    except ProfileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lengths(text: str) -> Lengths:
    try:
        return Lengths.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N or LOW-HIGH tokens, 1 <= LOW <= HIGH") from None


def _gpu_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give GPU counts as N[,N...], e.g. 2,4,8") from None
    if counts[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every GPU count must be 1 or more")
    return counts


def add_size_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``size`` to a ``hybrid-pd`` subparsers object."""
    size = subparsers.add_parser(
        "size",
        help="predict goodput per GPU of every layout (replicas, flex, xPyD) for a traffic, from a profile",
        description="Simulate every layout of each GPU count (colocated replicas, flexible workers, every xPyD "
        "split) under the traffic, and predict throughput, goodput within the SLOs, TTFT and TPOT. The profile "
        "says how one worker runs the model (docs/sizing.md).",
    )
    positive, output = checked(float, checks.positive), checked(Path, checks.output_file)
    size.add_argument(
        "--profile", type=_profile, action="append", required=True, metavar="PROFILE.json",
        help="the model's profile on one worker (hybrid-pd profile, or a shipped one's name: nemotron-h-8b-h100, tiny-cpu); again for workers of other tensor-parallel sizes: layouts then "
        "mix the sizes where the router pairs them",
    )  # fmt: skip
    size.add_argument("--gpus", type=_gpu_counts, required=True, metavar="N[,N...]", help="GPU counts to lay out, e.g. 2,4,8")
    size.add_argument("--input-len", type=_lengths, metavar="N|LOW-HIGH", help="prompt tokens (uniform over LOW-HIGH)")
    size.add_argument("--output-len", type=_lengths, metavar="N|LOW-HIGH", help="output tokens (uniform over LOW-HIGH)")
    size.add_argument(
        "--phases", metavar="IN/OUT@C[xN][:TTFT/TPOT],...",
        help="a traffic that changes phase instead (e.g. 1000/512@128x768:500/20,16000/256@32x256:4000/15,1000/512@128x768:500/20, "
        "one after the other; a phase's SLO is what its requests ask for in the x-slo-* headers, else --slo-ttft-ms/--slo-tpot-ms): "
        "the planner simulated on flexible workers, as the router runs it, against every fixed layout of one --gpus count",
    )  # fmt: skip
    load = size.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=at_least(1), metavar="C", help="closed loop: requests kept in flight")
    load.add_argument("--rate", type=positive, metavar="R", help="open loop: Poisson arrivals, requests/s")
    size.add_argument(
        "--num-prompts", type=at_least(1), metavar="K", help="requests to simulate (default: 5 x C, or 60 s x R; at least 200)"
    )
    size.add_argument(
        "--turns", type=at_least(1), default=1, metavar="T",
        help="multi-turn chat: each of C conversations (--concurrency) sends T turns, each the conversation so far plus "
        "--input-len tokens, routed by prefix_reuse and resumed from the prefix cache (default 1: independent requests)",
    )  # fmt: skip
    size.add_argument(
        "--system-len", type=at_least(0), default=0, metavar="N", help="multi-turn: each conversation's system prompt (default 0)"
    )
    size.add_argument("--slo-ttft-ms", type=positive, required=True, metavar="X", help="goodput: time to first token at most X ms")
    size.add_argument("--slo-tpot-ms", type=positive, required=True, metavar="Y", help="goodput: time per output token at most Y ms")
    size.add_argument("--seed", type=int, default=0, help="seed of the lengths and arrival times (default 0)")
    size.add_argument("--jobs", type=at_least(1), default=1, metavar="N", help="simulate N layouts at once in processes of their own (default 1)")
    size.add_argument("--json", dest="json_out", type=output, metavar="OUT", help="write every prediction")
    size.add_argument("--plot", type=output, metavar="OUT.png", help="draw goodput per GPU against GPUs (needs matplotlib)")
    size.add_argument(
        "--emit-kustomize", type=checked(Path, checks.output_dir), metavar="DIR",
        help="write a kustomize overlay over --k8s-base with the best layout's prefill/decode/flex replicas (one GPU count)",
    )  # fmt: skip
    size.add_argument(
        "--k8s-base", type=Path, metavar="DIR", help="the deploy/k8s variant the overlay names (default: this checkout's deploy/k8s/gpu-pd for a split, deploy/k8s/gpu for flexible workers)"
    )
    return size


def run_size(args: argparse.Namespace) -> int:
    """Run the ``size`` subcommand; returns the exit code."""
    from hybrid_pd.bench.plot import PlotUnavailable, require_matplotlib
    from hybrid_pd.sizing.layouts import layouts
    from hybrid_pd.sizing.report import best, format_table, plot_goodput, to_json
    from hybrid_pd.sizing.simulate import SLO, check_fits, size
    from hybrid_pd.sizing.workload import Workload, default_prompts

    try:
        profiles = profile_set(args.profile)
    except ProfileError as exc:
        return _usage(f"--profile: {exc}")
    if args.phases is not None:
        return _run_phases(args, profiles)
    if args.input_len is None or args.output_len is None or (args.concurrency is None and args.rate is None):
        return _usage("give --input-len, --output-len and --concurrency or --rate (or --phases)")
    if args.turns > 1 and args.concurrency is None:
        return _usage("--turns: multi-turn traffic is closed loop, give --concurrency (conversations at once), not --rate")
    workload = Workload(
        args.input_len, args.output_len, args.num_prompts or default_prompts(args.concurrency, args.rate), args.concurrency, args.rate,
        args.seed, args.turns, args.system_len,
    )  # fmt: skip
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    try:
        for profile in profiles.values():
            check_fits(profile, workload)
        if args.plot is not None:
            require_matplotlib()
    except ValueError as exc:
        lengths = "--input-len/--output-len" + ("/--turns/--system-len" if args.turns > 1 else "")
        return _usage(f"{lengths}: {exc}")
    except PlotUnavailable as exc:
        return _usage(str(exc))
    if args.emit_kustomize is not None and len(args.gpus) != 1:
        return _usage(f"--emit-kustomize: give one GPU count (--gpus {args.gpus[-1]}), the overlay deploys one layout")
    if empty := [g for g in args.gpus if not layouts(g, profiles)]:
        return _usage(f"--gpus: {empty[0]} GPUs hold no layout of workers of tensor_parallel_size {sorted(profiles)} (the profiles' sizes)")
    predictions = size(profiles, workload, slo, args.gpus, args.jobs)
    print(format_table(predictions, workload, slo))
    print("best per GPU count: " + ", ".join(f"{g}: {p.layout}" for g, p in best(predictions).items()), flush=True)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(to_json(list(profiles.values()), workload, slo, predictions), indent=1) + "\n")
    if args.plot is not None:
        first = next(iter(profiles.values()))
        title = f"{first.model} on {first.device}\n{workload.input_len}/{workload.output_len} tokens, {workload.load}, SLO {slo} ms"
        plot_goodput(predictions, title, args.plot)
    if args.emit_kustomize is not None:
        from hybrid_pd.sizing.kustomize import counts, write_overlay

        (picked,) = best(predictions).values()
        why = f"{workload.input_len}/{workload.output_len} tokens, {workload.load}, SLO TTFT {slo.ttft_ms:g} ms / TPOT {slo.tpot_ms:g} ms"
        try:
            path = write_overlay(picked, args.k8s_base, args.emit_kustomize, why)
        except ValueError as exc:
            return _usage(f"--k8s-base: {exc}")
        n = counts(picked)
        print(f"wrote {path}: prefill {n['prefill']}, decode {n['decode']}, flex {n['flex']} (kubectl apply -k {args.emit_kustomize})", flush=True)
    return 0


def _usage(problem: str) -> int:
    print(f"hybrid-pd size: {problem}", file=sys.stderr)
    return 2


def _run_phases(args: argparse.Namespace, profiles: dict) -> int:
    """``size --phases``: the planner on flexible workers against every fixed layout, under the same phases; table and JSON."""
    from hybrid_pd.router.settings import RouterSettings
    from hybrid_pd.sizing.planned import compare
    from hybrid_pd.sizing.report import format_phases
    from hybrid_pd.sizing.simulate import SLO, check_fits
    from hybrid_pd.sizing.workload import parse_phase

    if len(args.gpus) != 1 or set(profiles) != {1}:
        return _usage("--phases: give one --gpus count and a profile of one-GPU workers (the planner lays out flexible workers of one GPU)")
    if any(v is not None for v in (args.input_len, args.output_len, args.concurrency, args.rate, args.num_prompts)) or args.turns > 1:
        return _usage("--phases: the phases give the lengths and the load; leave out --input-len, --output-len, --concurrency, --rate, --num-prompts, --turns")
    try:
        phases = [parse_phase(text, args.seed + i) for i, text in enumerate(args.phases.split(","))]
        for phase in phases:
            check_fits(profiles[1], phase)
    except ValueError as exc:
        return _usage(f"--phases: {exc}")
    defaults = RouterSettings.model_fields  # the planner as the router runs it by default
    period, window, margin = (defaults[f"planner_{name}"].default for name in ("interval_s", "window_s", "margin"))
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    run, predictions, each = compare(profiles[1], args.gpus[0], phases, slo, period, window, margin)
    print(format_phases(predictions, each, run.changes, phases, slo))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        out = {"profile": profiles[1].model_dump(mode="json"), "phases": args.phases, "slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms},
               "planner": {"interval_s": period, "window_s": window, "margin": margin},
               "changes": [asdict(c) for c in run.changes], "predictions": [p.to_json() for p in predictions],
               "phase_predictions": [{"phase": text, "slo_ms": str(phase.slo or slo), "predictions": [p.to_json() for p in figures]}
                                     for text, phase, figures in zip(args.phases.split(","), phases, each, strict=True)]}  # fmt: skip
        args.json_out.write_text(json.dumps(out, indent=1) + "\n")
    return 0
