"""``hybrid-pd bench``: latency and throughput of an endpoint, and of a baseline beside it, under load.

Wired into ``hybrid-pd`` by :func:`add_bench_parser` and :func:`run_bench`; also runs on its
own as ``python -m hybrid_pd.bench ...``. This module only reads arguments and puts the pieces
together: targets and their models -> prompts -> each load level, endpoint then baseline ->
summaries -> table on stdout (and ``--json``, ``--plot``) -> exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid_pd.common import checks
from hybrid_pd.common.arg_types import at_least, checked

if TYPE_CHECKING:
    from hybrid_pd.bench.report import BenchReport
    from hybrid_pd.bench.runner import Load

__all__ = ["add_bench_parser", "main", "run_bench"]

log = logging.getLogger("hybrid_pd.bench")

DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_WARMUP = 1


def _loads(kind: str) -> Callable[[str], list[Load]]:
    """An argparse type: a comma-separated list of concurrencies or rates."""

    def parse(text: str) -> list[Load]:
        from hybrid_pd.bench.runner import parse_loads  # only when the flag is given: `hybrid-pd --help` stays light

        try:
            return parse_loads(kind, text)  # type: ignore[arg-type]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``bench`` to a ``hybrid-pd`` subparsers object."""
    bench: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="serving benchmark through the OpenAI API (TTFT, ITL, throughput, goodput; P/D beside a baseline)",
        description=(
            "Stream completions of exactly --output-len tokens for --num-prompts prompts of exactly --input-len "
            "random token ids, at each load level, from ENDPOINT and then BASELINE with the same prompts; report "
            "TTFT, ITL and end-to-end latency (p50/p90/p99), throughput and goodput under the SLOs. "
            "Exit codes: 0 every request completed, 2 bad usage, 3 requests failed or a target was unusable."
        ),
    )
    _add_arguments(bench)
    return bench


def _add_arguments(p: argparse.ArgumentParser) -> None:
    url, positive = checked(str, checks.http_url), checked(float, checks.positive)
    output = checked(Path, checks.output_file)
    p.add_argument("--endpoint", type=url, required=True, metavar="URL", help="the server to measure, e.g. the router")
    p.add_argument("--baseline", type=url, metavar="URL", help="a server to measure beside it, e.g. colocated vLLM")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument(
        "--concurrency",
        dest="loads",
        type=_loads("concurrency"),
        metavar="C[,C...]",
        help="load levels as requests kept in flight, e.g. 1,8,32",
    )
    load.add_argument(
        "--rate",
        dest="loads",
        type=_loads("rate"),
        metavar="R[,R...]",
        help="load levels as Poisson arrival rates in requests/s (inf: all at once)",
    )
    p.add_argument("--input-len", type=at_least(1), required=True, metavar="N", help="prompt tokens per request")
    p.add_argument("--output-len", type=at_least(1), required=True, metavar="M", help="output tokens per request")
    p.add_argument("--num-prompts", type=at_least(1), required=True, metavar="K", help="requests per level and target")
    p.add_argument("--slo-ttft-ms", type=positive, metavar="X", help="goodput: time to first token at most X ms")
    p.add_argument("--slo-itl-ms", type=positive, metavar="Y", help="goodput: mean inter-token latency at most Y ms")
    p.add_argument("--json", dest="json_out", type=output, metavar="OUT", help="write the report (every request too)")
    p.add_argument("--plot", type=output, metavar="OUT.png", help="draw latency against load (needs matplotlib)")
    p.add_argument(
        "--timeline",
        type=Path,
        metavar="DIR",
        help="the --timeline-dir of the endpoint's router and workers, readable here: print the hand-off budget of "
        "each level (where the endpoint's TTFT goes, segment by segment) and add it to --json",
    )
    p.add_argument("--model", help="model name to request (default: the first of each target's /v1/models)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times (default 0)")
    p.add_argument(
        "--vocab-size",
        type=at_least(1),
        metavar="V",
        help="draw token ids from [0, V) (default: the served model's tokenizer when its directory is readable "
        "here, else 256)",
    )
    p.add_argument(
        "--warmup",
        type=at_least(0),
        default=DEFAULT_WARMUP,
        metavar="W",
        help=f"unmeasured requests per target before the first level (default {DEFAULT_WARMUP})",
    )
    p.add_argument(
        "--request-timeout-s",
        type=positive,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help=f"per request (default {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run the ``bench`` subcommand; returns the exit code."""
    from hybrid_pd.bench.client import EndpointError
    from hybrid_pd.bench.plot import PlotUnavailable, plot_latency, require_matplotlib
    from hybrid_pd.bench.report import EXIT_ERRORS, EXIT_USAGE, format_table
    from hybrid_pd.eval.report import write_json

    if args.plot is not None:
        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            log.error("%s", exc)
            return EXIT_USAGE
    run_id = uuid.uuid4().hex[:12] if args.timeline is not None else None
    try:
        report = asyncio.run(_bench(args, run_id))
    except EndpointError as exc:
        log.error("%s", exc)
        return EXIT_ERRORS
    print(format_table(report), flush=True)
    out = report.to_json()
    if run_id is not None:
        out["timeline"] = _timeline(args.timeline, run_id, report)
    if args.json_out is not None:
        write_json(out, args.json_out)
        log.info("wrote %s", args.json_out)
    if args.plot is not None:
        plot_latency(report, args.plot)
        log.info("wrote %s", args.plot)
    return report.exit_code


def _timeline(directory: Path, run_id: str, report: BenchReport) -> dict:
    """Print the endpoint's hand-off budget at each level of this run (requests named ``run_id``); the JSON of them.

    A baseline whose router and workers record into the same folder (P/D before a change,
    the endpoint after it) gets its budget beside, under ``baseline_levels``.
    """
    from hybrid_pd.bench.budget import budget, format_budget
    from hybrid_pd.bench.runner import level_request_ids
    from hybrid_pd.bench.timeline import load_events, timelines

    found = timelines(load_events(directory)) if directory.is_dir() else []
    out: dict = {"dir": str(directory), "run_id": run_id}
    for role, key in (("endpoint", "levels"), ("baseline", "baseline_levels")):
        levels = []
        for level in report.levels:
            prefix = level_request_ids(run_id, role, level.load) + "-"
            b = budget(prefix[:-1], [t for t in found if t.rid.startswith(prefix)])
            if not b.requests:
                if role == "endpoint":
                    log.warning("no request of %s is traced in %s: are the router and workers started with --timeline-dir %s?", level.load.label, directory, directory)
                else:
                    continue  # a colocated baseline: nothing to trace
            print("\n" + format_budget(b, f"{role} hand-off budget at {level.load.label}"), flush=True)
            levels.append({"load": level.load.to_json(), **b.to_json()})
        if levels or role == "endpoint":
            out[key] = levels
    return out


async def _bench(args: argparse.Namespace, run_id: str | None) -> BenchReport:
    import httpx

    from hybrid_pd.bench.client import ClientPool, EndpointError, Sampling, model_entry
    from hybrid_pd.bench.prompts import FALLBACK_VOCAB_SIZE, random_prompts, vocab_size_of
    from hybrid_pd.bench.report import BenchConfig, build_report
    from hybrid_pd.bench.runner import Target, run_levels, warm_up
    from hybrid_pd.bench.stats import SLO

    loads: list[Load] = args.loads
    timeout = httpx.Timeout(args.request_timeout_s, connect=min(10.0, args.request_timeout_s))
    async with httpx.AsyncClient(timeout=timeout) as client, ClientPool(timeout) as pool:
        targets, roots = [], []
        for role, url in (("endpoint", args.endpoint), ("baseline", args.baseline)):
            if url is None:
                continue
            entry = {"id": args.model} if args.model else await model_entry(client, url)
            targets.append(Target(role, url, entry["id"]))
            roots.append(entry.get("root"))
        vocab = args.vocab_size or vocab_size_of(args.model) or vocab_size_of(roots[0])
        if vocab is None and args.model:  # the name was given: ask for the directory anyway, quietly
            try:
                vocab = vocab_size_of((await model_entry(client, args.endpoint)).get("root"))
            except EndpointError:  # only a better default is at stake
                vocab = None
        if vocab is None:
            vocab = FALLBACK_VOCAB_SIZE
            log.info("the model's vocabulary is unknown here; token ids from [0, %d) (--vocab-size to change)", vocab)
        slo = SLO(
            ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
            itl_s=None if args.slo_itl_ms is None else args.slo_itl_ms / 1e3,
        )
        config = BenchConfig(
            input_len=args.input_len,
            output_len=args.output_len,
            num_prompts=args.num_prompts,
            seed=args.seed,
            vocab_size=vocab,
            warmup=args.warmup,
            slo=slo,
        )
        k = args.num_prompts
        prompts = random_prompts(args.warmup + k * len(loads), args.input_len, vocab, args.seed)
        warmup, measured = prompts[: args.warmup], prompts[args.warmup :]
        level_prompts = [measured[i * k : (i + 1) * k] for i in range(len(loads))]
        for target in targets:
            await warm_up(pool, target, warmup, Sampling(target.model, args.output_len))
        runs = await run_levels(pool, targets, level_prompts, args.output_len, loads, seed=args.seed, run_id=run_id)
    return build_report(config, targets, runs)


def main(argv: list[str] | None = None) -> int:
    """``python -m hybrid_pd.bench ...``: the ``bench`` subcommand without the rest of ``hybrid-pd``."""
    from hybrid_pd.common.logs import add_log_level_flag, configure_logging

    parser = argparse.ArgumentParser(prog="python -m hybrid_pd.bench", description=__doc__.splitlines()[0])
    add_log_level_flag(parser)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    return run_bench(args)
