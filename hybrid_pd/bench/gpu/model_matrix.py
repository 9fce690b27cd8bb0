"""The GPU model matrix: every hybrid family through P/D at its published per-layer shapes, on one GPU or two.

Run on a machine with NVIDIA GPUs and vLLM + NIXL installed (see ../shared/gpu/README.md):

    python3 -m hybrid_pd.bench.gpu.model_matrix --out results/ [--families nemotron_h,qwen3_next] [--prompt-tokens 1,127,128,129,900,3000]

Heterogeneous TP: ``--prefill-gpus 0,1 --decode-gpus 1`` (prefill TP=2 -> decode TP=1) or
``--prefill-gpus 0 --decode-gpus 0,1`` (TP=1 -> TP=2): each worker's TP size is the number of
GPUs it is given (``CUDA_VISIBLE_DEVICES``); the transfers a request makes and the bytes they move
are then ``hybrid-pd plan``'s for those TP sizes (one read per prefill rank a decode rank holds
state from, per decode rank), and the baseline is the decode worker alone, at its own TP size.

For each family of ``hybrid_pd/models/families.py`` it builds a random-weight bf16 checkpoint
with the published per-layer shapes (hidden size, Mamba/GDN heads and dims, state size, groups,
attention heads; layers, vocabulary, MLP/expert widths and expert counts cut: docs/models.md)
and starts, all families at once, a prefill worker, a decode worker (vLLM's GPU default,
FULL_AND_PIECEWISE CUDA graphs, ``--cudagraph-metrics``) and a router. Then per family:

1. decode row: one 1000-token prompt, ``max_tokens=1``, through P/D; the decode worker's
   CUDA-graph statistics for that interval must show one 1-token FULL step and nothing else
   (token N recomputed as a decode row from the pulled state);
2. P/D vs colocated for each prompt length (and the attention block's boundaries): greedy
   tokens and logprobs through the router against the decode worker answering alone (the
   same engine computing the whole prompt, as a colocated server does), compared up to the
   first divergence with the colocated top-2 logprob gap there (bf16 near-ties);
   exactly the planned NIXL transfers per request (one with equal TP), none failed, no router
   fallback, and the bytes vLLM counts equal to ``hybrid-pd plan`` for the config.

``--speculative-config JSON`` (e.g. ``{"method": "mtp", "num_speculative_tokens": 2}``): the
families with an MTP head are built with a random one and both P/D workers speculate; the
baseline is then a colocated server *without* speculation (greedy speculative decoding is
lossless, so P/D + MTP must answer as plain decoding does; ``--baseline-speculates`` gives it
the same speculation, to test the split alone), and the decode worker's draft
acceptance is reported (near zero: the heads are random). The planned bytes then include the
MTP head's KV, the longer conv states and the draft state blocks where the installed vLLM moves
them (``hybrid_pd.connector.plan.Speculation``).

A family whose servers do not start is recorded with the error lines of its logs, not
dropped. Writes ``summary.json`` (updated as each family finishes) and every log to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]

from hybrid_pd.bench.gpu.gsm8k_gate import NEAR_TIE, device_name, versions
from hybrid_pd.bench.gpu.pd_check import cli, compare, completion, cudagraph_rows, metrics_of
from hybrid_pd.common.logs import error_lines
from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.connector.plan import PlanError, Speculation, attention_block_size, draft_tokens, model_shape, plan_transfer, registered_shape
from hybrid_pd.connector.vllm.capabilities import moves_draft_state_blocks
from hybrid_pd.models.families import FAMILIES, build, language_config

XFERS, FAILED, BYTES = "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_num_failed_transfers_total", "vllm:nixl_bytes_transferred_sum"
XFER_SECONDS, FALLBACKS = "vllm:nixl_xfer_time_seconds_sum", "hybrid_pd_fallbacks_total"
DRAFTS, ACCEPTED = "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"
MAX_MODEL_LEN = 4096
ONE_PIXEL_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="


def prompt_ids(tokens: int, vocab: int, start: int = 7) -> list[int]:
    """Token ids clear of the special ones (0-9), spread over the vocabulary."""
    return [(start + 13 * i) % (vocab - 20) + 10 for i in range(tokens)]


def log_errors(log: Path, limit: int = 12) -> list[str]:
    """The lines of a server's log that say why it failed, their last 400 characters each."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line[-400:] for line in error_lines(text.splitlines(), limit)]


def one_full_decode_row(before: list[tuple], after: list[tuple]) -> bool:
    """Whether the stats table logged after one ``max_tokens=1`` P/D request shows exactly one 1-token FULL step.

    ``before``/``after`` are the last CUDA-graph tables of the decode log around the request
    (``cudagraph_rows``); no new table means the step was not logged.
    """
    if after == before:
        return False
    return [(unpadded, mode.removeprefix("CUDAGraphMode."), count) for unpadded, _padded, mode, count in after] == [(1, "FULL", 1)]


def decode_row(urls: dict[str, str], name: str, vocab: int, log: Path) -> dict:
    """One 1000-token prompt, max_tokens=1, through P/D: the decode worker's one step, by CUDA-graph mode."""
    time.sleep(11)  # a quiet stats interval first: vLLM logs CUDA-graph stats every 10 s
    before = cudagraph_rows(log)
    completion(urls["router"], name, prompt_ids(1000, vocab, start=3), 1)
    time.sleep(12)
    after = cudagraph_rows(log)
    return {"rows": after, "one_full_1_token_step": one_full_decode_row(before, after)}


def one_prompt(
    urls: dict[str, str], name: str, vocab: int, tokens: int, shape, block: int, max_tokens: int, tp: tuple[int, int],
    drafting: Speculation | None = None, fresh_cache: bool = False,
) -> dict:  # fmt: skip
    """One prompt through P/D and through the baseline, with vLLM's counters around the P/D one; ``tp``: (prefill, decode).

    ``urls``: the router, the decode worker and, where the baseline is another server (one that
    does not speculate, say), ``colocated``; without it the decode worker alone is the baseline.
    ``drafting``: the P/D workers' MTP speculation, which the planned bytes count.
    ``fresh_cache``: workers with prefix caching on; the P/D request and the baseline each carry a
    fresh ``cache_salt``, so neither hits a block an earlier request left: these prompts share
    their first tokens, and a baseline on the decode worker would otherwise resume from the
    blocks the P/D request just pulled (measured on CPU: the block + 1 prompt after the block one
    then moved nothing, the decode worker recomputing it).
    """
    prompt = prompt_ids(tokens, vocab)
    salts = (uuid.uuid4().hex, uuid.uuid4().hex) if fresh_cache else (None, None)
    plan = plan_transfer(shape, tokens, prefill_tp=tp[0], decode_tp=tp[1], block_size=block, speculation=drafting)
    names = (XFERS, FAILED, BYTES, XFER_SECONDS)
    before = [metrics_of(urls["decode"], n) for n in names] + [metrics_of(urls["router"], FALLBACKS)]
    pd = completion(urls["router"], name, prompt, max_tokens, salts[0])
    counters_settled(urls["decode"], before[0], transfer_planned=plan.transfers > 0)
    after = [metrics_of(urls["decode"], n) for n in names] + [metrics_of(urls["router"], FALLBACKS)]
    xfers, failed, moved, seconds, fallbacks = (a - b for a, b in zip(after, before, strict=True))
    colocated = completion(urls.get("colocated", urls["decode"]), name, prompt, max_tokens, salts[1])
    return {"prompt_tokens": tokens, **compare(pd, colocated), "transfers": xfers, "planned_transfers": plan.transfers,
            "failed_transfers": failed, "fallbacks": fallbacks, "bytes": moved, "planned_bytes": plan.total_bytes,
            "transfer_ms": round(seconds * 1e3, 3)}  # fmt: skip


def counters_settled(decode_url: str, transfers_before: float, transfer_planned: bool, timeout_s: float = 10) -> None:
    """Wait until the decode worker's transfer counters hold a request's transfers.

    vLLM updates them after the step that saw a transfer end, so a read right after the answer
    can miss it: wait for the count to move (a transfer planned), then for the bytes to stop moving
    (half a second apart; two seconds in all where none is planned, to catch one that should not be).
    """
    deadline = time.monotonic() + timeout_s
    while transfer_planned and metrics_of(decode_url, XFERS) == transfers_before and time.monotonic() < deadline:
        time.sleep(0.2)
    quiet_until = time.monotonic() + (0.5 if transfer_planned else 2.0)
    last = metrics_of(decode_url, BYTES)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = metrics_of(decode_url, BYTES)
        if now == last and time.monotonic() >= quiet_until:
            return
        last = now


def image_request(router: str, name: str) -> dict:
    """A chat request with an image through the router of a multimodal checkpoint's P/D workers, which serve its text half.

    Refused with an OpenAI-style 4xx is the expected answer (``hybrid_pd.connector.launch.language_model_only_args``):
    a 200 would mean the image was dropped or went through a hand-off nothing here has checked.
    """
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + ONE_PIXEL_PNG}}
    body = {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]}
    r = httpx.post(router + "/v1/chat/completions", json=body, timeout=60)
    return {"status": r.status_code, "body": r.text[:300]}


def verdict(result: dict) -> str:
    """PASS: decode row FULL, every prompt the planned clean transfers of the planned bytes, tokens equal up to bf16 near-ties;
    a multimodal checkpoint's image request refused with a 4xx."""
    prompts = result.get("prompts", [])
    if not prompts:
        return "FAIL"
    clean = all(
        (p["transfers"], p["failed_transfers"], p["fallbacks"]) == (p["planned_transfers"], 0, 0) and p["bytes"] == p["planned_bytes"]
        for p in prompts
    )
    ties = all(p["first_divergence"] is None or (p["top2_gap_at_divergence"] or 0) <= NEAR_TIE for p in prompts)
    image_refused = 400 <= result.get("image_request", {"status": 400})["status"] < 500
    return "PASS" if clean and ties and image_refused and result.get("decode_row", {}).get("one_full_1_token_step") else "FAIL"


def run_family(name: str, procs: dict, urls: dict[str, str], model_dir: Path, out: Path, args, results: dict, lock: threading.Lock) -> None:
    result: dict = {"family": name, "architecture": FAMILIES[name].architecture, "published": FAMILIES[name].published}
    started = time.monotonic()
    try:
        for role in [r for r in ("prefill", "decode", "colocated", "router") if r in procs]:
            if not wait_http_ok(urls[role] + "/health", lambda p=procs[role]: p.poll() is None, args.ready_timeout_s):
                raise RuntimeError(f"{role} did not start")
        result["ready_s"] = round(time.monotonic() - started, 1)
        shape = model_shape(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        vocab = language_config(config)["vocab_size"]
        tp = (args.prefill_tp, args.decode_tp)
        drafting = Speculation(draft_tokens(args.speculative_config), moves_draft_state_blocks()) if args.speculative_config else None
        result["plan_per_request_1000_tokens"] = plan_transfer(shape, 1000, prefill_tp=tp[0], decode_tp=tp[1], speculation=drafting).to_json()
        for _ in range(2):  # first requests compile and handshake
            completion(urls["router"], name, prompt_ids(300, vocab, start=5), 4)
            completion(urls["decode"], name, prompt_ids(300, vocab, start=5), 4)
        log = (out / f"{name}-decode.log").read_text(errors="replace")
        shape = registered_shape(log, shape, tp=args.decode_tp, drafts=drafting.tokens if drafting else 0)  # the dtypes its vLLM runs
        block = attention_block_size(log, shape, tp=args.decode_tp)
        result["attention_block_size"] = block
        result["decode_row"] = decode_row(urls, name, vocab, out / f"{name}-decode.log")
        lengths = sorted({*args.prompt_tokens, block - 1, block, block + 1} & set(range(1, MAX_MODEL_LEN - args.max_tokens)))
        drafts_before = [metrics_of(urls["decode"], n) for n in (DRAFTS, ACCEPTED)]
        result["prompts"] = [one_prompt(urls, name, vocab, n, shape, block, args.max_tokens, tp, drafting) for n in lengths]
        if shape.multimodal:
            result["image_request"] = image_request(urls["router"], name)
        if args.speculative_config:
            drafts, accepted = (metrics_of(urls["decode"], n) - b for n, b in zip((DRAFTS, ACCEPTED), drafts_before, strict=True))
            result["speculative_config"] = args.speculative_config
            result["drafts"] = {"proposed": drafts, "accepted": accepted, "acceptance": round(accepted / drafts, 4) if drafts else None}
    except (RuntimeError, httpx.HTTPError, PlanError, OSError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["log_errors"] = {role: log_errors(out / f"{name}-{role}.log") for role in procs}
    result["verdict"] = verdict(result)
    print(json.dumps({k: result.get(k) for k in ("family", "verdict", "ready_s", "attention_block_size", "drafts", "error")}), flush=True)
    print(f"  {name} decode row: {result.get('decode_row')}", flush=True)
    for row in result.get("prompts", []):
        print(f"  {name} {json.dumps(row)}", flush=True)
    with lock:
        results[name] = result
        (out / "summary.json").write_text(json.dumps({**results["_run"], "families": {k: v for k, v in results.items() if k != "_run"}}, indent=1))


def start_family(name: str, model_dir: Path, out: Path, args) -> tuple[dict, dict[str, str]]:
    """The family's prefill, decode worker and router; with ``--speculative-config`` both workers speculate and a colocated server, on the decode GPUs, does not."""
    roles = [("prefill", args.prefill_gpus), ("decode", args.decode_gpus)] + [("colocated", args.decode_gpus)] * bool(args.speculative_config)
    ports = {role: free_port() for role in [r for r, _ in roles] + ["router"]}
    common = ["--model", str(model_dir), "--served-model-name", name, "--device", args.device, "--dtype", args.dtype, "--max-model-len", str(MAX_MODEL_LEN),
              "--max-num-seqs", "16", "--gpu-memory-utilization", str(args.gpu_memory_utilization),
              "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30))), "--vllm-arg=--cudagraph-metrics"]  # fmt: skip
    speculation = ["--speculative-config", args.speculative_config] if args.speculative_config else []
    # The builder's multimodal checkpoints carry a vision tower's weights but no image processor, and
    # their tokenizer has no vision tokens: a colocated server of one serves text (as the P/D workers do).
    text_only = ["--vllm-arg=--language-model-only"] if model_shape(model_dir).multimodal else []
    procs = {
        role: spawn(
            cli(role, *common, "--port", str(ports[role]), "--tensor-parallel-size", str(len(gpus)),
                *(["--side-channel-port", str(free_port())] if role != "colocated" else text_only),
                *(speculation if role != "colocated" or args.baseline_speculates else [])),  # fmt: skip
            env={"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if args.device == "cuda" else None,
            log=out / f"{name}-{role}.log",
        )
        for role, gpus in roles
    }
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    procs["router"] = spawn(
        cli("router", "--port", str(ports["router"]), "--prefill", urls["prefill"], "--decode", urls["decode"]), log=out / f"{name}-router.log"
    )
    return procs, urls


def with_text_config(model_dir: Path, changes: dict) -> Path:
    """``model_dir`` with ``changes`` merged into its language config (a multimodal checkpoint's ``text_config``)."""
    if changes:
        config = json.loads((model_dir / "config.json").read_text())
        language_config(config).update(changes)
        (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return model_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated names from hybrid_pd/models/families.py")
    ap.add_argument("--prompt-tokens", default="1,127,128,129,900,3000", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--models", type=Path, default=Path("/tmp/hybrid-pd-matrix"), help="where the checkpoints are built")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.05)
    ap.add_argument("--kv-cache-gib", type=float, default=1.5)
    ap.add_argument("--ready-timeout-s", type=float, default=480)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of this script (no CUDA graphs: the decode row FAILs)")
    gpu_list = lambda s: [g for g in s.split(",") if g]  # noqa: E731
    ap.add_argument("--prefill-gpus", type=gpu_list, default=["0"], help="CUDA devices of each family's prefill worker; its TP size is their count")
    ap.add_argument("--decode-gpus", type=gpu_list, default=["0"], help="CUDA devices of each family's decode worker; its TP size is their count")
    ap.add_argument("--speculative-config", help="both P/D workers speculate (vLLM's JSON); families with an MTP head only; baseline: colocated without")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the checkpoints' and workers' dtype (vLLM's auto would run a float32 checkpoint in bf16 on a GPU): float32 tells kernel rounding from lost state")
    ap.add_argument("--text-config", type=json.loads, default={},
                    help="JSON merged into each checkpoint's language config after it is built, a diagnostic (e.g. '{\"num_experts_per_tok\": 8}': every token to every expert)")
    ap.add_argument("--baseline-speculates", action="store_true", help="with --speculative-config: the colocated baseline speculates the same way (P/D alone under test)")
    args = ap.parse_args()
    args.prefill_tp, args.decode_tp = len(args.prefill_gpus), len(args.decode_gpus)
    args.out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    without_head = [n for n in names if args.speculative_config and FAMILIES[n].mtp is None]
    if without_head:
        ap.error(f"--speculative-config: {without_head} have no MTP head here")
    results: dict = {"_run": {"device": device_name(), "versions": versions(), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                              "prefill_gpus": args.prefill_gpus, "decode_gpus": args.decode_gpus,
                              "speculative_config": args.speculative_config, "baseline_speculates": args.baseline_speculates, "dtype": args.dtype, "text_config": args.text_config}}  # fmt: skip
    started = time.monotonic()
    mtp = bool(args.speculative_config)
    variant = ",".join(f"{k}={v}" for k, v in sorted(args.text_config.items()))  # one directory per diagnostic
    models_dir = args.models / ("mtp" if mtp else "") / ("" if args.dtype == "bfloat16" else args.dtype) / variant
    models = {
        n: models_dir / n if (models_dir / n / "config.json").exists() else with_text_config(build(n, models_dir / n, scale="published", mtp=mtp, dtype=args.dtype), args.text_config)
        for n in names
    }
    print(f"checkpoints built in {time.monotonic() - started:.0f} s", flush=True)
    servers = {n: start_family(n, models[n], args.out, args) for n in names}
    lock = threading.Lock()
    threads = [threading.Thread(target=run_family, args=(n, *servers[n], models[n], args.out, args, results, lock)) for n in names]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for procs, _ in servers.values():
            for proc in procs.values():
                stop_group(proc, grace_s=10)
    verdicts = {n: results[n]["verdict"] for n in names}
    print(json.dumps(verdicts), f"{time.monotonic() - started:.0f} s in all", flush=True)
    return 0 if all(v == "PASS" for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
