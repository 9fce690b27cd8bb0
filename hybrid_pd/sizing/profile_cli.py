"""``hybrid-pd profile``: measure one running vLLM server and write the profile ``hybrid-pd size`` reads.

Wired into ``hybrid-pd`` by :func:`add_profile_parser` and :func:`run_profile`. It starts nothing:
the server (``hybrid-pd colocated``, ``vllm serve``) runs already and serves nothing else
meanwhile. This module reads the arguments and the server's facts (its model from
``/v1/models``, the model's ``config.json``, its KV cache from ``/metrics``), runs the plan
(:mod:`.profiler`) through :mod:`.measure`, fits and writes the profile. Bad input is answered on
one line naming the flag, exit code 2, before anything is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import sys
from pathlib import Path

import httpx

from hybrid_pd.bench.client import ClientPool, EndpointError, base_url, model_entry
from hybrid_pd.bench.prompts import FALLBACK_VOCAB_SIZE, vocab_size_of
from hybrid_pd.common import checks
from hybrid_pd.common.arg_types import at_least, checked
from hybrid_pd.connector.plan import PlanError, model_shape
from hybrid_pd.sizing import measure
from hybrid_pd.sizing.fitting import fit_transfer
from hybrid_pd.sizing.profile import MAMBA_CACHE_MODES, Profile, ProfileError
from hybrid_pd.sizing.profiler import FULL, QUICK, Measurements, Plan, Settings, attention_block_tokens, fit_profile

__all__ = ["BASE_PROFILE", "add_profile_parser", "run_profile"]

log = logging.getLogger("hybrid_pd.sizing.profile")
MIN_DECODE_POINTS = 3

BASE_PROFILE = Path(__file__).resolve().parent.parent / "bench" / "results" / "2026-11-25-h100x2-sizing" / "profile.json"
TIMEOUT_S = 600.0


def add_profile_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``profile`` to a ``hybrid-pd`` subparsers object."""
    p = subparsers.add_parser(
        "profile",
        help="measure one running vLLM server and write the profile hybrid-pd size reads",
        description="Measure a running OpenAI-compatible vLLM server (lone prompts' TTFT, a prefill burst, decode "
        "steps at several batches and contexts, and optionally the NIXL transfers of a P/D pair) and fit the "
        "profile hybrid-pd size reads (docs/sizing.md). The server must serve nothing else meanwhile.",
    )
    url, output = checked(str, checks.http_url), checked(Path, checks.output_file)
    p.add_argument("--url", type=url, required=True, help="the server, e.g. http://127.0.0.1:8100")
    p.add_argument("--out", type=output, required=True, metavar="PROFILE.json", help="where the profile goes")
    p.add_argument("--max-num-seqs", type=at_least(1), required=True, metavar="N", help="the server's --max-num-seqs (vLLM exports it nowhere)")
    p.add_argument(
        "--max-num-batched-tokens", type=at_least(1), required=True, metavar="N",
        help="the server's token budget per step (--max-num-batched-tokens; vLLM's default: 8192 on an H100, 2048 on CPU)",
    )  # fmt: skip
    p.add_argument(
        "--tensor-parallel-size", type=at_least(1), default=1, metavar="N",
        help="the server's --tensor-parallel-size: the profile is of a worker on N GPUs (hybrid-pd size lays out workers of each size it has a profile of)",
    )  # fmt: skip
    p.add_argument(
        "--cache-bytes", type=at_least(1), metavar="B",
        help="the server's KV cache in bytes over all its GPUs (default: its --kv-cache-memory-bytes, from vllm:cache_config_info, "
        "times --tensor-parallel-size)",
    )  # fmt: skip
    p.add_argument(
        "--block-tokens", type=at_least(1), metavar="N",
        help="vLLM's attention block for this model (default: the smallest multiple of 16 whose page holds a Mamba layer's state, as on GPU)",
    )  # fmt: skip
    p.add_argument(
        "--mamba-cache-mode", choices=MAMBA_CACHE_MODES,
        help="vLLM's Mamba cache mode on the server (default: its vllm:cache_config_info; 'all' keeps a state per block, which prefix caching sets on GPU)",
    )  # fmt: skip
    p.add_argument("--model-config", type=Path, metavar="config.json", help="the model's config (default: config.json of the model directory /v1/models names)")
    p.add_argument("--device", default="unknown device", help="what the profile says it ran on, e.g. 'NVIDIA H100 80GB HBM3'")
    p.add_argument("--quick", action="store_true", help="a small plan: short prompts, small batches (a CPU smoke)")
    p.add_argument("--base", type=Path, default=BASE_PROFILE, metavar="PROFILE.json", help="the hand-off, and the transfer unless measured, come from here")
    p.add_argument("--transfer-router", type=url, metavar="URL", help="a P/D router of the same model: lone requests through it measure the transfer")
    p.add_argument(
        "--transfer-metrics", type=url, action="append", default=[], metavar="URL",
        help="a decode worker behind --transfer-router whose /metrics count its NIXL transfers (repeat for each)",
    )  # fmt: skip
    p.add_argument("--measurements-json", type=output, metavar="OUT", help="also write what was measured, before the fit")
    p.add_argument("--vocab-size", type=at_least(1), help="token ids of the random prompts (default: the model's tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    return p


def run_profile(args: argparse.Namespace) -> int:
    """Run the ``profile`` subcommand; returns the exit code."""
    if bool(args.transfer_router) != bool(args.transfer_metrics):
        return _usage("--transfer-router and --transfer-metrics go together: the router's requests are counted on its decode workers")
    try:
        base = Profile.load(args.base)
    except ProfileError as exc:
        return _usage(f"--base: {exc}")
    try:
        profile, measured = asyncio.run(_profile(args, base))
    except (EndpointError, measure.MeasureError, PlanError, _Usage) as exc:
        return _usage(str(exc))
    except httpx.HTTPError as exc:
        return _usage(f"--url {args.url}: {type(exc).__name__}: {exc}")
    except ValueError as exc:  # a fit the measurements do not determine
        print(f"hybrid-pd profile: cannot fit a profile: {exc}", file=sys.stderr)
        return 1
    profile.save(args.out)
    if args.measurements_json is not None:
        args.measurements_json.parent.mkdir(parents=True, exist_ok=True)
        args.measurements_json.write_text(json.dumps(measured.to_json(), indent=1) + "\n")
    d = profile.decode
    print(f"wrote {args.out}: decode step {d.base_ms:.3f} ms + {d.per_seq_ms:.4f} ms a row + {d.per_context_token_ms:.2e} ms a context token; "
          f"prefill {profile.prefill_per_token_ms:.5f} ms a token; prompt latency {[(n, round(ms, 1)) for n, ms in profile.prompt_latency_ms]}; "
          f"transfer {profile.transfer.latency_ms:.2f} ms + bytes / {profile.transfer.bandwidth_gbps:.1f} GB/s", flush=True)  # fmt: skip
    return 0


class _Usage(Exception):
    """The server lacks something the profile needs, and a flag can give it."""


async def _profile(args: argparse.Namespace, base: Profile) -> tuple[Profile, Measurements]:
    async with httpx.AsyncClient(timeout=30) as client:
        entry = await model_entry(client, args.url)
        version = await _version(client, args.url)
        per_gpu = None if args.cache_bytes else await measure.cache_info(client, args.url, "kv_cache_memory_bytes")
        mamba_cache_mode = args.mamba_cache_mode or await measure.cache_info(client, args.url, "mamba_cache_mode") or "none"
        router_entry = await model_entry(client, args.transfer_router) if args.transfer_router else None
    cache = args.cache_bytes or (int(per_gpu) * args.tensor_parallel_size if per_gpu is not None else None)  # vLLM's is per GPU
    if cache is None:
        raise _Usage(f"--cache-bytes: {args.url} was started without --kv-cache-memory-bytes; give its KV cache in bytes")
    config = args.model_config or (Path(entry["root"]) / "config.json" if entry.get("root") else None)
    if config is None or not Path(config).is_file():
        raise _Usage(f"--model-config: {args.url} serves {entry['id']!r}, whose config.json is not readable here; give its path")
    shape = model_shape(config)
    if mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise _Usage(f"{args.url} reports Mamba cache mode {mamba_cache_mode!r}, which the profile does not model ({', '.join(MAMBA_CACHE_MODES)})")
    block = args.block_tokens or attention_block_tokens(shape, _block_alignment(Path(config), mamba_cache_mode))
    log.info("Mamba cache mode %s, attention block %d tokens%s", mamba_cache_mode, block, "" if args.block_tokens else " (vLLM's rule; --block-tokens sets it)")
    settings = Settings(
        model=f"{entry['id']} ({entry.get('root', '?')}), vLLM {version}", device=args.device, shape=shape, block_tokens=block, cache_bytes=cache,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=args.tensor_parallel_size,
        mamba_cache_mode=mamba_cache_mode,
    )  # fmt: skip
    server_profile = settings.draft(base)
    plan = (QUICK if args.quick else FULL).shaped(server_profile, int(entry.get("max_model_len") or 1 << 20))
    vocab = args.vocab_size or vocab_size_of(entry.get("root")) or FALLBACK_VOCAB_SIZE
    server = measure.Server(args.url, entry["id"], vocab)
    router = measure.Server(args.transfer_router, router_entry["id"], vocab) if router_entry else None
    measured = await _measure(plan, server, server_profile, router, args.transfer_metrics, args.seed)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if measured.transfers and measured.transfer_error is None:
        transfer = f"transfer measured through {args.transfer_router} (vLLM's NIXL counters of {', '.join(args.transfer_metrics)})"
    elif router is not None:
        transfer = f"transfer through {args.transfer_router} not measured ({measured.transfer_error}), kept from {args.base.name}: {base.source}"
    else:
        transfer = f"transfer not measured (no --transfer-router: the server alone moves no state), kept from {args.base.name}: {base.source}"
    left_out = f"; decode points left out: {'; '.join(measured.decode_left_out)}" if measured.decode_left_out else ""
    source = (f"measured by hybrid-pd profile{' --quick' if args.quick else ''} against {base_url(args.url)} on {when}; "
              f"hand-off kept from {args.base.name} (one server has none); {transfer}{left_out}")  # fmt: skip
    return fit_profile(measured, settings, base, source), measured


async def _measure(plan: Plan, server: measure.Server, settings: Profile, router: measure.Server | None, decode_metrics: list[str], seed: int) -> Measurements:
    async with ClientPool(TIMEOUT_S) as pool:
        log.info("warm-up: %d requests", plan.warmup)
        await measure.lone_ttfts(pool, server, plan.prompt_lens[:1], plan.warmup, seed + 999)
        log.info("lone TTFT at %s tokens, %d each", plan.prompt_lens, plan.repeats)
        lone = await measure.lone_ttfts(pool, server, plan.prompt_lens, plan.repeats, seed)
        requests = plan.burst_requests(settings)
        log.info("prefill bursts: %d x %d prompts of %d tokens", plan.repeats, requests, plan.burst_prompt_len)
        bursts = [await measure.burst_rps(pool, server, plan.burst_prompt_len, requests, seed + 100 + i) for i in range(plan.repeats)]
        decode, left_out = [], []
        for i, (n, rows) in enumerate(plan.decode_batches(settings)):
            outs = plan.decode_tries(rows, n, settings, measure.DECODE_TRIES)
            log.info("decode: %d rows of %d+%d tokens", rows, n, outs[0])
            try:
                decode.append(await measure.decode_point(pool, server, rows, n, outs, seed + 200 + i))
            except measure.MeasureError as exc:  # the other points still fit the step; the profile says which is missing
                left_out.append(str(exc))
                log.warning("decode point left out: %s", exc)
        if len(decode) < MIN_DECODE_POINTS:  # a step of three terms needs three points
            raise measure.MeasureError(f"{len(decode)} decode points decoded together, {MIN_DECODE_POINTS} fit a step: {'; '.join(left_out)}")
        transfers, error = [], None
        if router is not None:
            log.info("transfers through %s at %s tokens", router.url, plan.prompt_lens)
            try:
                transfers = await measure.transfer_points(pool, router, decode_metrics, plan.prompt_lens, plan.repeats, seed + 300)
                fit_transfer(transfers)
            except (measure.MeasureError, httpx.HTTPError, ValueError) as exc:  # the rest of the profile stands without it
                error = f"{type(exc).__name__}: {exc}"
                log.warning("transfer not measured, the base profile's kept: %s", error)
    return Measurements(lone, plan.burst_prompt_len, requests, bursts, decode, transfers, error, left_out)


def _block_alignment(config: Path, mamba_cache_mode: str) -> int:
    """What vLLM's attention block is a multiple of: the Mamba chunk when it caches Mamba states (1152 = 9 x 128 tokens
    for Nemotron-H-8B with prefix caching on an H200, vLLM 0.26; 1040 without), else 16."""
    if mamba_cache_mode == "none":
        return 16
    cfg = json.loads(config.read_text())
    cfg = cfg.get("text_config", cfg)
    return int(cfg.get("mamba_chunk_size") or cfg.get("chunk_size") or 16)


async def _version(client: httpx.AsyncClient, url: str) -> str:
    try:
        return str((await client.get(base_url(url) + "/version")).json().get("version", "?"))
    except (httpx.HTTPError, ValueError, AttributeError):
        return "?"


def _usage(problem: str) -> int:
    print(f"hybrid-pd profile: {problem}", file=sys.stderr)
    return 2

