"""``hybrid-pd``: one command line for the whole service.

- ``hybrid-pd up``: router + prefill + decode workers on this machine, in the foreground.
- ``hybrid-pd router|prefill|decode``: one service each (what containers run);
  ``hybrid-pd colocated``: a plain vLLM server, the baseline P/D is compared to.

Bad input is answered like the router answers a bad request: one line that names the
flag (or environment variable) and what to give instead, exit code 2, before anything
starts; never a traceback. Values are checked where they are declared: argparse types
here, validators on the settings models (:mod:`hybrid_pd.common.checks` for both).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from hybrid_pd.bench.cli import add_bench_parser, run_bench
from hybrid_pd.common import checks
from hybrid_pd.common.arg_types import at_least, checked
from hybrid_pd.common.cli_flags import add_flags, given
from hybrid_pd.common.logs import add_log_level_flag, configure_logging, kv
from hybrid_pd.eval.cli import add_eval_parser, run_eval
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.sizing.cli import add_size_parser, run_size
from hybrid_pd.sizing.profile_cli import add_profile_parser, run_profile
from hybrid_pd.worker import ROLES
from hybrid_pd.worker.settings import WorkerSettings

__all__ = ["UsageError", "main", "build_parser"]

log = logging.getLogger("hybrid_pd.cli")

S = TypeVar("S", bound=BaseModel)

# Settings whose values an error message must not repeat.
_SECRETS = ("admin_token", "api_keys")


class UsageError(Exception):
    """Bad input found after parsing: :func:`main` prints the message on one line and exits 2."""


class InvalidSettings(Exception):
    """A settings model refused values; :func:`main` names each one by the flag or variable it came from."""

    def __init__(self, model: type[BaseModel], error: ValidationError, from_flags: dict[str, Any]) -> None:
        super().__init__(str(error))
        self.model, self.error, self.from_flags = model, error, from_flags

    def describe(self, flags: dict[str, str]) -> str:
        """One line: each refused value, as ``--flag VALUE: why`` or ``PREFIX_NAME=VALUE: why``."""
        problems = []
        for e in self.error.errors():
            name = str(e["loc"][0]) if e["loc"] else ""
            value = "***" if name in _SECRETS else e.get("input")
            if name in self.from_flags and name in flags:
                where = f"{flags[name]} {value}"
            else:
                where = f"{self.model.model_config.get('env_prefix', '')}{name.upper()}={value}"
            problems.append(f"{where}: {e['msg'].removeprefix('Value error, ')}")
        return "; ".join(problems)


def _settings(model: type[S], args: argparse.Namespace) -> S:
    """``model`` from the environment, overridden by the flags ``args`` gave."""
    from_flags = given(args, model)
    try:
        return model(**from_flags)
    except ValidationError as exc:
        raise InvalidSettings(model, exc, from_flags) from None
    except SettingsError as exc:  # a list or tuple setting whose variable is not JSON
        field = re.search(r'field "(\w+)"', str(exc))
        name = f"{model.model_config.get('env_prefix', '')}{field.group(1).upper()}" if field else "a variable"
        raise UsageError(f'{name}: not a JSON list; write it as ["a", "b"] (or [] for none)') from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-pd", description=__doc__.splitlines()[0])
    add_log_level_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run router + prefill + decode workers locally (foreground)")
    up.add_argument(
        "--model", type=checked(str, checks.model_ref), help="model directory (default: the embedded tiny hybrid model)"
    )
    up.add_argument("--host", default="127.0.0.1", help="router bind address")
    up.add_argument("--port", type=checked(int, checks.tcp_port), default=8000, help="router port")
    up.add_argument("--prefill", type=at_least(0), default=1, help="number of prefill workers")
    up.add_argument("--decode", type=at_least(0), default=1, help="number of decode workers")
    up.add_argument("--flex", type=at_least(0), default=0, help="number of flexible workers (prefill, decode or both, as the router decides)")
    up.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the workers run vLLM")
    up.add_argument("--baseline", action="store_true", help="also start a colocated vLLM server to compare with")
    up.add_argument(
        "--router-arg", dest="router_args", action="append", default=[], metavar="ARG",
        help="another router flag, e.g. --router-arg=--slo-ttft-ms=500 (repeatable; hybrid-pd router --help lists them)",
    )  # fmt: skip
    up.add_argument(
        "--log-dir",
        type=checked(Path, checks.output_dir),
        help="where each service's log goes (default: .hybrid-pd/logs)",
    )
    up.add_argument(
        "--timeline-dir",
        type=checked(Path, checks.output_dir),
        help="the router and the P/D workers record the hand-off timeline here (hybrid-pd bench --timeline reads it)",
    )

    router = sub.add_parser("router", help="run the router")
    add_flags(router, RouterSettings)
    router.add_argument("--dry-run", action="store_true", help="print the resolved settings as JSON and exit")

    for role, summary in ROLES.items():
        worker = sub.add_parser(role, help=summary)
        add_flags(worker, WorkerSettings)
        worker.add_argument("--dry-run", action="store_true", help="print the vLLM command and environment as JSON and exit")
    add_eval_parser(sub)
    add_bench_parser(sub)
    add_size_parser(sub)
    add_profile_parser(sub)

    plan = sub.add_parser("plan", help="bytes and reads of the state one request moves, per TP layout")
    plan.add_argument("--model", help="local model directory or its config.json (default: the embedded model)")
    plan.add_argument("--prefill-tp", type=at_least(1), default=1, help="one TP size must divide the other")
    plan.add_argument("--decode-tp", type=at_least(1), default=1)
    plan.add_argument("--prompt-tokens", type=at_least(1), default=1000)
    plan.add_argument("--block-size", type=at_least(1), default=128)
    plan.add_argument(
        "--decode-cached-tokens", type=at_least(0), default=0,
        help="the prompt's first tokens the decode worker's prefix cache holds (whole blocks): only the rest moves",
    )  # fmt: skip
    plan.add_argument(
        "--bandwidth-gbps", type=checked(float, checks.positive), default=25.0, help="GB/s used for the time estimate"
    )
    plan.add_argument(
        "--speculative-config",
        type=checked(str, checks.json_object),
        help="the workers' MTP speculation, vLLM's JSON (e.g. {\"method\": \"mtp\", \"num_speculative_tokens\": 2})",
    )
    plan.add_argument(
        "--vllm-moves-draft-state",
        choices=["auto", "yes", "no"],
        default="auto",
        help="with --speculative-config: whether vLLM's NIXL connector moves the draft state blocks "
        "(auto: ask the installed vLLM; 0.26 does, 0.32 does not)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from hybrid_pd.router.app import create_app

    settings = _settings(RouterSettings, args)
    if args.dry_run:
        shown = settings.model_dump(mode="json")
        shown["api_keys"] = ["***"] * len(settings.api_keys)
        shown["admin_token"] = "***" if settings.admin_token else None
        print(json.dumps(shown))
        return 0
    log.info("router on http://%s:%d prefill=%s decode=%s", settings.host, settings.port, settings.prefill, settings.decode)
    app = create_app(settings)
    if settings.timeline_dir:
        from hybrid_pd.connector.trace.http import TimelineMiddleware
        from hybrid_pd.connector.trace.timeline import writer_for

        app = TimelineMiddleware(app, writer_for(settings.timeline_dir, "router"))
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None, access_log=False)
    return 0


def _run_worker(args: argparse.Namespace) -> int:
    settings = _settings(WorkerSettings, args)
    if args.dry_run:
        from hybrid_pd.connector.launch import build_launch

        launch = build_launch(settings.spec(args.command))
        print(json.dumps({"argv": launch.argv, "env": launch.env}))
        return 0
    # Where the model is depends on the machine that runs vLLM: this one now, not the one a dry run prints for.
    try:
        checks.model_ref(settings.model)
    except ValueError as exc:
        where = f"--model {settings.model}" if args.model else f"HYBRID_PD_WORKER_MODEL={settings.model}"
        raise UsageError(f"{where}: {exc}") from None
    from hybrid_pd.worker.run import run_worker

    return run_worker(args.command, settings)


def _ready_message(stack: Any, model_name: str) -> str:
    lines = [f"hybrid-pd ready: {stack.url}  (model {model_name!r}; Ctrl-C stops everything)"]
    baseline = stack.workers("colocated")
    if baseline:
        lines.append(f"colocated baseline: {baseline[0].url}")
    question = "Question: Maya has 41 beads. She buys 37 more beads. How many beads does Maya have now?\nAnswer:"
    body = json.dumps({"model": model_name, "prompt": question, "max_tokens": 64, "temperature": 0, "stop": ["Question:"]})
    lines.append(f"try:  curl -s {stack.url}/v1/completions -H 'Content-Type: application/json' -d '{body}'")
    return "\n".join(lines)


def _draft_state_moved(choice: str) -> bool:
    """``--vllm-moves-draft-state``: the operator's answer, or the installed vLLM's."""
    if choice != "auto":
        return choice == "yes"
    try:
        from hybrid_pd.connector.vllm.capabilities import moves_draft_state_blocks

        return moves_draft_state_blocks()
    except ImportError as exc:
        raise UsageError(
            f"--speculative-config: cannot ask the installed vLLM whether its NIXL connector moves the draft state blocks ({exc}); "
            "give --vllm-moves-draft-state yes (vLLM 0.26) or no (vLLM 0.32)"
        ) from None


def _run_plan(args: argparse.Namespace) -> int:
    from hybrid_pd.connector.contract import LOCAL_PROMPT_TOKENS
    from hybrid_pd.connector.plan import PlanError, Speculation, draft_tokens, model_shape, plan_transfer
    from hybrid_pd.default_model import resolve_model

    try:
        shape = model_shape(resolve_model(args.model)[0])
        drafts = draft_tokens(args.speculative_config) if args.speculative_config else 0
        drafting = Speculation(drafts, _draft_state_moved(args.vllm_moves_draft_state)) if drafts else None
        plan = plan_transfer(
            shape, args.prompt_tokens, args.prefill_tp, args.decode_tp, args.block_size, args.bandwidth_gbps, drafting, args.decode_cached_tokens
        )
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"model": shape.__dict__, "plan": plan.to_json()}))
        return 0
    rows = [
        ("mamba / attention layers", f"{shape.mamba_layers} / {shape.attention_layers}"
         + (f" + {shape.mtp_attention_layers} MTP" if drafting else "")),  # fmt: skip
        ("layer slots moved (vLLM's padding)", f"{plan.mamba_layers_moved} / {plan.attention_layers_moved}"),
        ("tokens moved (N-1)", f"{plan.transferred_tokens} in {plan.blocks} block(s) of {args.block_size}"),
        ("state blocks per Mamba layer", str(plan.state_blocks_per_mamba_layer)),
        ("conv state per Mamba layer (x, B, C)", f"{plan.conv_bytes_per_mamba_layer:,} B per block"),
        ("SSM state per Mamba layer", f"{plan.ssm_bytes_per_mamba_layer:,} B per block"),
        ("KV per attention layer", f"{plan.kv_bytes_per_attention_layer:,} B"),
        ("total per request", f"{plan.total_bytes:,} B"),
        ("per decode rank", f"{plan.bytes_per_decode_rank:,} B from {plan.prefill_ranks_per_decode_rank} prefill rank(s)"),
        ("reads per decode rank (at most)", str(plan.max_reads_per_decode_rank)),
        ("NIXL transfers", str(plan.transfers)),
        ("decode rank <- prefill ranks", ", ".join(f"{d}<-{s}" for d, s in plan.decode_rank_sources.items())
         or f"none: the decode worker computes prompts of up to {LOCAL_PROMPT_TOKENS} tokens itself"),
        (f"time at {args.bandwidth_gbps:g} GB/s", f"{plan.seconds_at_bandwidth * 1e3:.3f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops ``up`` the way Ctrl-C does."""
    raise KeyboardInterrupt


def _planner_profile(args: argparse.Namespace) -> tuple[str, ...]:
    """The router flag that gives ``up --flex N`` (N >= 2) its planner: the embedded model's shipped profile for the device,
    unless a ``--router-arg`` names one; for another model, a warning: its flexible workers serve whole requests."""
    from hybrid_pd.default_model import DEFAULT_PROFILES

    if args.flex < 2 or any(a.startswith("--planner-profile") for a in args.router_args):
        return ()
    if args.model is None and args.device in DEFAULT_PROFILES:
        return (f"--planner-profile={DEFAULT_PROFILES[args.device]}",)
    log.warning(
        "the %d flexible workers serve whole requests: no profile of %s on %s for the planner; measure one (hybrid-pd profile) "
        "and pass --router-arg=--planner-profile=PROFILE.json", args.flex, args.model or "the embedded model", args.device,
    )  # fmt: skip
    return ()


def _run_up(args: argparse.Namespace) -> int:
    from hybrid_pd.common.processes import listen_problem
    from hybrid_pd.default_model import resolve_model
    from hybrid_pd.stack import Stack, StackConfig, StackError, watch

    if (problem := listen_problem(args.host, args.port)) is not None:
        raise UsageError(f"the router cannot listen on {problem}: stop what uses it, or pass another --port or --host")
    if args.decode + args.flex == 0:
        raise UsageError("--decode 0 --flex 0: the stack needs a worker that decodes; give --decode or --flex at least 1")
    model, name = resolve_model(args.model)
    router_args = tuple(args.router_args) + _planner_profile(args)
    config = StackConfig(
        model=model,
        served_model_name=name,
        host=args.host,
        port=args.port,
        prefill=args.prefill,
        decode=args.decode,
        flex=args.flex,
        router_args=router_args,
        device=args.device,
        baseline=args.baseline,
        timeline_dir=args.timeline_dir,
        **({"log_dir": args.log_dir} if args.log_dir else {}),
    )
    stack = Stack(config)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        log.info("starting %s; logs in %s", kv(prefill=args.prefill, decode=args.decode, flex=args.flex), config.log_dir)
        stack.start()
        print(_ready_message(stack, name), flush=True)
        log.error("%s; stopping the stack", watch(stack))
        return 1
    except StackError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        log.info("stopping")
        return 0
    finally:
        stack.stop()


def _flags(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """dest -> flag of ``command``'s options (``api_keys`` -> ``--api-key``)."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {a.dest: a.option_strings[0] for a in sub.choices[command]._actions if a.option_strings}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    runners = {"up": _run_up, "router": _run_router, **dict.fromkeys(ROLES, _run_worker), "eval": run_eval, "bench": run_bench, "plan": _run_plan, "size": run_size, "profile": run_profile}
    try:
        return runners[args.command](args)
    except InvalidSettings as exc:
        problem = exc.describe(_flags(parser, args.command))
    except UsageError as exc:
        problem = str(exc)
    print(f"hybrid-pd {args.command}: {problem}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
