"""``hybrid-pd eval gsm8k``: GSM8K accuracy of an endpoint, and of P/D against a baseline.

Wired into ``hybrid-pd`` by :func:`add_eval_parser` and :func:`run_eval`; also runs on
its own as ``python -m hybrid_pd.eval gsm8k ...``. This module only reads arguments and
puts the pieces together: questions -> prompts -> each endpoint's generations -> scores
-> comparison and gate -> text report on stdout (and ``--json``) -> exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid_pd.common import checks
from hybrid_pd.common.arg_types import at_least, checked

if TYPE_CHECKING:
    from hybrid_pd.eval.data import Problem
    from hybrid_pd.eval.report import EndpointRun

__all__ = ["add_eval_parser", "main", "run_eval"]

log = logging.getLogger("hybrid_pd.eval")

DEFAULT_CONCURRENCY = 32
DEFAULT_TOLERANCE = 0.05  # vLLM's NIXL P/D accuracy test's tolerance on gsm8k strict-match
DEFAULT_REQUEST_TIMEOUT_S = 600.0


def _fraction(text: str) -> float:
    """An argparse type: a number between 0 and 1."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def add_eval_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``eval`` (with its ``gsm8k`` subcommand) to a ``hybrid-pd`` subparsers object."""
    evaluate: argparse.ArgumentParser = subparsers.add_parser(
        "eval", help="accuracy evaluation through the OpenAI API (e.g. P/D against colocated)"
    )
    _add_tasks(evaluate)
    return evaluate


def _add_tasks(parser: argparse.ArgumentParser) -> None:
    """The evaluation tasks, as subcommands of ``parser`` (``args.eval_task`` names the one chosen)."""
    from hybrid_pd.eval.datasets import DATASETS
    from hybrid_pd.eval.prompts import DEFAULT_MAX_TOKENS, DEFAULT_SHOTS

    tasks = parser.add_subparsers(dest="eval_task", required=True, metavar="TASK")
    p = tasks.add_parser(
        "gsm8k",
        help="GSM8K, k-shot, greedy, scored like lm-eval's gsm8k task",
        description=(
            "Ask ENDPOINT (and BASELINE) the GSM8K test questions through /v1/completions, score them like "
            "lm-eval's gsm8k task (strict-match, flexible-extract) and compare the two. Exit codes: 0 passed, "
            "1 the accuracy difference or the agreement failed the gate, 2 bad usage, 3 requests failed."
        ),
        epilog=(
            "Exporting the problems for other tools: `hybrid-pd eval gsm8k --dataset synthetic --limit 200 "
            "--export-jsonl DIR` writes DIR/test.jsonl (the questions this command would ask: --dataset, --seed, "
            "--limit) and DIR/train.jsonl (the train split; the --shots examples are its first lines) in GSM8K's "
            "JSONL format: one {\"question\": ..., \"answer\": ...} object a line, each answer ending in "
            "'#### N'. Tools that read GSM8K from files take them as they are, e.g. lm_eval's gsm8k task copied "
            "with dataset_path: json, dataset_name: null and dataset_kwargs: {data_files: {train: DIR/train.jsonl, "
            "test: DIR/test.jsonl}}. Without --endpoint it only writes the files; with it, it also evaluates."
        ),
    )
    url = checked(str, checks.http_url)
    p.add_argument(
        "--endpoint",
        type=url,
        metavar="URL",
        help="the server to evaluate, e.g. the P/D router http://router:8000 (required unless --export-jsonl)",
    )
    p.add_argument(
        "--baseline",
        type=url,
        metavar="URL",
        help="a server to compare with, e.g. colocated vLLM http://colocated:8000",
    )
    p.add_argument("--limit", type=at_least(1), metavar="N", help="only the first N test questions (default: all)")
    p.add_argument(
        "--shots",
        type=at_least(0),
        default=DEFAULT_SHOTS,
        metavar="K",
        help=f"solved train examples before each question (default {DEFAULT_SHOTS})",
    )
    p.add_argument(
        "--concurrency",
        type=at_least(1),
        default=DEFAULT_CONCURRENCY,
        metavar="C",
        help=f"requests in flight per endpoint (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--json",
        dest="json_out",
        type=checked(Path, checks.output_file),
        metavar="OUT",
        help="write every question's prompt, generations and scores here",
    )
    p.add_argument(
        "--tolerance",
        type=_fraction,
        default=DEFAULT_TOLERANCE,
        metavar="T",
        help=f"largest allowed |strict-match accuracy difference|, in accuracy units (default {DEFAULT_TOLERANCE})",
    )
    p.add_argument(
        "--min-agreement",
        type=_fraction,
        default=0.0,
        metavar="A",
        help="smallest allowed fraction of identical generations (default 0)",
    )
    p.add_argument(
        "--dataset",
        choices=DATASETS,
        default="gsm8k",
        help="gsm8k (vendored) or synthetic problems in its format (default gsm8k)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic dataset (default 0)")
    p.add_argument("--model", help="model name to request (default: the first of each endpoint's /v1/models)")
    p.add_argument(
        "--max-tokens",
        type=at_least(1),
        default=DEFAULT_MAX_TOKENS,
        metavar="M",
        help=f"generation limit per question (default {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--request-timeout-s",
        type=checked(float, checks.positive),
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help=f"per request (default {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--export-jsonl",
        type=checked(Path, checks.output_dir),
        metavar="DIR",
        help="write the problems as GSM8K-format DIR/test.jsonl and DIR/train.jsonl for other tools (see below)",
    )


def run_eval(args: argparse.Namespace) -> int:
    """Run the ``eval`` subcommand that ``args`` names; returns the exit code."""
    if args.eval_task == "gsm8k":
        return _run_gsm8k(args)
    raise ValueError(f"unknown eval task {args.eval_task!r}")


def _run_gsm8k(args: argparse.Namespace) -> int:
    from hybrid_pd.eval.client import EndpointError
    from hybrid_pd.eval.datasets import load_problems
    from hybrid_pd.eval.prompts import STOP, build_prompt, fewshot_prefix
    from hybrid_pd.eval.report import (
        EXIT_ERRORS,
        EXIT_OK,
        EXIT_USAGE,
        Gate,
        RunInfo,
        compare,
        format_report,
        json_report,
        write_json,
    )

    if args.endpoint is None and args.export_jsonl is None:
        log.error("give --endpoint URL (the server to evaluate), or --export-jsonl DIR to only write the problems")
        return EXIT_USAGE
    problems = load_problems(args.dataset, "test", limit=args.limit, seed=args.seed)
    shots = load_problems(args.dataset, "train", limit=args.shots, seed=args.seed) if args.shots else []
    if len(shots) < args.shots:
        log.error("the %s train split has only %d problems for --shots %d", args.dataset, len(shots), args.shots)
        return EXIT_USAGE
    if args.export_jsonl is not None:
        _export(args.export_jsonl, problems, load_problems(args.dataset, "train", seed=args.seed))
        if args.endpoint is None:
            return EXIT_OK
    prefix = fewshot_prefix(shots)
    prompts = [build_prompt(prefix, problem) for problem in problems]
    info = RunInfo(
        task="gsm8k",
        dataset=args.dataset,
        shots=args.shots,
        max_tokens=args.max_tokens,
        stop=STOP,
        seed=args.seed if args.dataset == "synthetic" else None,
    )
    targets = [("endpoint", args.endpoint)] + ([("baseline", args.baseline)] if args.baseline else [])

    try:
        runs = asyncio.run(_ask_all(targets, problems, prompts, args))
    except EndpointError as exc:
        log.error("%s", exc)
        return EXIT_ERRORS

    comparison = compare(runs[0], runs[1]) if len(runs) == 2 else None
    gate = Gate(tolerance=args.tolerance, min_agreement=args.min_agreement)
    verdict = gate.check(runs, comparison)
    print(format_report(info, runs, comparison, gate, verdict), flush=True)
    if args.json_out is not None:
        write_json(json_report(info, problems, prompts, runs, comparison, gate, verdict), args.json_out)
        log.info("wrote %s", args.json_out)
    return verdict.exit_code


def _export(folder: Path, test: Sequence[Problem], train: Sequence[Problem]) -> None:
    """The problems as GSM8K's files: ``test.jsonl`` (the questions asked) and ``train.jsonl`` (the shots' split)."""
    from hybrid_pd.eval.data import write_jsonl

    folder.mkdir(parents=True, exist_ok=True)
    for name, problems in (("test", test), ("train", train)):
        write_jsonl(problems, folder / f"{name}.jsonl")
        log.info("wrote %d problems to %s", len(problems), folder / f"{name}.jsonl")


async def _ask_all(
    targets: Sequence[tuple[str, str]], problems: Sequence[Problem], prompts: Sequence[str], args: argparse.Namespace
) -> list[EndpointRun]:
    """Each target's run, one target after the other (so they do not compete for shared hardware)."""
    import httpx

    from hybrid_pd.eval.client import Sampling, generate_all, resolve_model
    from hybrid_pd.eval.progress import Progress
    from hybrid_pd.eval.report import EndpointRun

    timeout = httpx.Timeout(args.request_timeout_s, connect=min(10.0, args.request_timeout_s))
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    runs: list[EndpointRun] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for role, url in targets:
            model = args.model or await resolve_model(client, url)
            log.info(
                "asking %s %s (model %r) %d questions, %d at a time", role, url, model, len(prompts), args.concurrency
            )
            progress = Progress(role, len(prompts))
            started = time.perf_counter()
            try:
                generations = await generate_all(
                    client, url, prompts, Sampling(model, args.max_tokens), args.concurrency, progress
                )
            finally:
                progress.close()
            runs.append(EndpointRun.scored(role, url, model, problems, generations, time.perf_counter() - started))
    return runs


def main(argv: list[str] | None = None) -> int:
    """``python -m hybrid_pd.eval ...``: the ``eval`` subcommand without the rest of ``hybrid-pd``."""
    from hybrid_pd.common.logs import add_log_level_flag, configure_logging

    parser = argparse.ArgumentParser(prog="python -m hybrid_pd.eval", description=__doc__.splitlines()[0])
    add_log_level_flag(parser)
    _add_tasks(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    return run_eval(args)
