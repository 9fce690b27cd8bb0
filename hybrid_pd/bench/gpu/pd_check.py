"""GPU evidence for hybrid P/D: FULL CUDA-graph decode rows, P/D vs colocated, GSM8K agreement.

Run on a machine with one NVIDIA GPU and vLLM + NIXL installed (see ../shared/gpu/README.md):

    python3 -m hybrid_pd.bench.gpu.pd_check --out results/ [--prompts 8] [--gsm8k-limit 100]

It builds a random-weight NemotronH-style hybrid of realistic shape (bf16), starts
through ``hybrid-pd`` a prefill worker, a decode worker (FULL_AND_PIECEWISE CUDA
graphs, ``--cudagraph-metrics``), a colocated server and the router on one GPU,
then:

1. decode row: sends one long prompt with ``max_tokens=1`` through P/D and reads the
   decode worker's CUDA-graph statistics: the only step it ran is 1 token in FULL mode
   (the recomputed token N), while the colocated server ran the whole prompt;
2. P/D vs colocated: greedy tokens and logprobs for several prompts, compared up to the
   first divergence, with the top-2 logprob gap at that token (bf16 near-ties);
3. ``hybrid-pd eval gsm8k`` through the router against the colocated server;
4. with ``--bench 1,8,32``: ``hybrid-pd bench`` P/D (router) vs colocated, 1000-token prompts.

Writes ``summary.json`` and the servers' logs to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]

from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.common.prom import metric_sum

SHAPE = dict(
    vocab_size=512,
    hidden_size=1024,
    layers_block_type=["mamba", "mamba", "attention", "mlp", "mamba", "mamba", "mlp", "mamba", "mamba", "attention",
                       "mlp", "mamba", "mamba", "mlp"],  # fmt: skip
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2048,
    mamba_num_heads=32,
    mamba_head_dim=64,
    n_groups=8,
    ssm_state_size=128,
    conv_kernel=4,
    chunk_size=128,
    max_position_embeddings=8192,
    use_mamba_kernels=False,
    initializer_range=0.02,
)


def build_model(out: Path) -> None:
    """A random-weight hybrid of realistic shape, with the project's tokenizer recipe."""
    import torch
    from transformers import AutoModelForCausalLM, NemotronHConfig

    from hybrid_pd.default_model import ensure_default_model

    tokenizer_dir = ensure_default_model()
    for name in os.listdir(tokenizer_dir):
        if "token" in name or name.endswith(".jinja") or name == "special_tokens_map.json":
            (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    tok_cfg = json.loads((tokenizer_dir / "config.json").read_text())
    config = NemotronHConfig(
        **SHAPE,
        pad_token_id=tok_cfg.get("pad_token_id", 0),
        bos_token_id=tok_cfg.get("bos_token_id", 1),
        eos_token_id=tok_cfg.get("eos_token_id", 2),
        architectures=["NemotronHForCausalLM"],
    )
    config.vocab_size = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params", flush=True)


def gpu_model() -> Path:
    """``$HYBRID_PD_GPU_MODEL`` (default ``/tmp/hybrid-pd-gpu-model``), built there on first use."""
    model_dir = Path(os.environ.get("HYBRID_PD_GPU_MODEL", "/tmp/hybrid-pd-gpu-model"))
    if not (model_dir / "config.json").exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        build_model(model_dir)
    return model_dir


def wait_all_ready(procs: dict, urls: dict[str, str], logs: Path, started: float, timeout_s: float = 540) -> float:
    """Wait for every server's ``/health``; exit naming the one that did not start. Returns seconds since ``started``."""
    for name, proc in procs.items():
        if not wait_http_ok(urls[name] + "/health", lambda p=proc: p.poll() is None, timeout_s):
            raise SystemExit(f"{name} did not start; see {logs / (name + '.log')}")
    ready_s = round(time.monotonic() - started, 1)
    print(f"all ready in {ready_s} s", flush=True)
    return ready_s


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybrid_pd.cli", *args]


def metrics_of(url: str, name: str) -> float:
    return metric_sum(httpx.get(url + "/metrics", timeout=10).text, name)


def _cudagraph_tables(log: Path) -> list[list[tuple[int, int, str, int]]]:
    """Every CUDAGraph Stats table vLLM logged in ``log`` (one per stats interval), as (unpadded, padded, mode, count) rows."""
    tables = log.read_text(errors="replace").split("**CUDAGraph Stats:**")[1:]
    row = r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*\d+\s*\|\s*([A-Za-z_.]+)\s*\|\s*(\d+)\s*\|"
    return [[(int(a), int(b), mode, int(c)) for a, b, mode, c in re.findall(row, table)] for table in tables]


def cudagraph_rows(log: Path) -> list[tuple[int, int, str, int]]:
    """(unpadded, padded, mode, count) rows of vLLM's last CUDAGraph Stats table in ``log``."""
    tables = _cudagraph_tables(log)
    return tables[-1] if tables else []


def cudagraph_steps_by_mode(log: Path) -> dict[str, int]:
    """Steps per CUDA-graph mode (FULL, PIECEWISE, NONE) over every stats table in ``log``."""
    steps: dict[str, int] = {}
    for table in _cudagraph_tables(log):
        for _unpadded, _padded, mode, count in table:
            name = mode.removeprefix("CUDAGraphMode.")
            steps[name] = steps.get(name, 0) + count
    return steps


def completion(url: str, model: str, prompt, max_tokens: int, cache_salt: str | None = None) -> dict:
    """Greedy tokens with top-2 logprobs; ``cache_salt`` (vLLM's per-request salt of the prefix-cache hashes): a fresh
    one keeps the request from hitting blocks any other request left on a server with prefix caching on."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2, "return_token_ids": True}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]


def compare(pd: dict, co: dict) -> dict:
    """Tokens up to the first divergence and the colocated top-2 logprob gap there."""
    a, b = pd["token_ids"], co["token_ids"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    lp_a, lp_b = pd["logprobs"]["token_logprobs"], co["logprobs"]["token_logprobs"]
    upto = first if first is not None else len(a)
    worst = max((abs(x - y) for x, y in zip(lp_a[:upto], lp_b[:upto])), default=0.0)
    gap = None
    if first is not None:
        top = sorted(co["logprobs"]["top_logprobs"][first].values(), reverse=True)
        gap = top[0] - top[1] if len(top) > 1 else None
    return {"tokens": len(a), "first_divergence": first, "top2_gap_at_divergence": gap, "max_logprob_delta_before": worst}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gsm8k-limit", type=int, default=100)
    ap.add_argument("--bench", metavar="LEVELS", help="also run `hybrid-pd bench` at these concurrencies, e.g. 1,8,32")
    ap.add_argument("--skip-checks", action="store_true", help="only the benchmark (with --bench)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = gpu_model()
    name = "hybrid-gpu"
    common = ["--model", str(model_dir), "--served-model-name", name, "--device", "cuda", "--max-model-len", "4096",
              "--max-num-seqs", "64", "--gpu-memory-utilization", "0.25", "--kv-cache-memory-bytes", str(8 << 30)]  # fmt: skip
    ports = {role: free_port() for role in ("prefill", "decode", "colocated", "router")}
    procs = {}
    started = time.monotonic()
    for role in ("prefill", "decode", "colocated"):
        argv = cli(role, *common, "--port", str(ports[role]), "--vllm-arg=--cudagraph-metrics")
        if role != "colocated":
            argv += ["--side-channel-port", str(free_port())]
        procs[role] = spawn(argv, log=args.out / f"{role}.log")
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    procs["router"] = spawn(
        cli("router", "--port", str(ports["router"]), "--prefill", urls["prefill"], "--decode", urls["decode"]),
        log=args.out / "router.log",
    )
    summary: dict = {"model_shape": SHAPE}
    try:
        summary["ready_s"] = wait_all_ready(procs, urls, args.out, started, timeout_s=600)

        # Warm up both paths (first requests are slow), then let a stats interval pass.
        for _ in range(2):
            completion(urls["router"], name, "warm up " * 50, 4)
            completion(urls["colocated"], name, "warm up " * 50, 4)
        time.sleep(11)

        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        if not args.skip_checks:
            run_checks(args, urls, name, vocab, summary)
        if args.bench:
            bench = subprocess.run(
                cli("bench", "--endpoint", urls["router"], "--baseline", urls["colocated"], "--concurrency", args.bench,
                    "--input-len", "1000", "--output-len", "64", "--num-prompts", "64", "--slo-ttft-ms", "500",
                    "--slo-itl-ms", "20", "--json", str(args.out / "bench.json")),  # fmt: skip
                capture_output=True, text=True, timeout=900,
            )
            summary["bench_exit_code"] = bench.returncode
            print(bench.stdout[-6000:], bench.stderr[-2000:], flush=True)
    finally:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps({k: v for k, v in summary.items() if k != "gsm8k_report"}, indent=1), flush=True)
        for proc in procs.values():
            stop_group(proc, grace_s=10)
    return 0


def run_checks(args: argparse.Namespace, urls: dict[str, str], name: str, vocab: int, summary: dict) -> None:
    """Checks 1-3: decode row, P/D vs colocated, GSM8K."""
    # 1. Decode row: one 1000-token prompt, max_tokens=1, through P/D.
    prompt = [(17 * i) % (vocab - 20) + 10 for i in range(1000)]
    transfers = metrics_of(urls["decode"], "vllm:nixl_xfer_time_seconds_count")
    before = cudagraph_rows(args.out / "decode.log")
    completion(urls["router"], name, prompt, 1)
    time.sleep(12)  # vLLM logs CUDA-graph stats every 10 s
    summary["decode_row"] = {
        "transfers": metrics_of(urls["decode"], "vllm:nixl_xfer_time_seconds_count") - transfers,
        "decode_cudagraph_rows_before": before,
        "decode_cudagraph_rows_after": cudagraph_rows(args.out / "decode.log"),
        "mode_lines": sorted({line.strip() for line in (args.out / "decode.log").read_text().splitlines() if "cudagraph_mode" in line.lower() and "FULL" in line})[:3],
    }

    # 2. P/D vs colocated, greedy, 64 tokens.
    results = []
    for i in range(args.prompts):
        p = [(31 * j + 7 * i) % (vocab - 20) + 10 for j in range(200 + 100 * i)]
        results.append({"prompt_tokens": len(p), **compare(completion(urls["router"], name, p, 64), completion(urls["colocated"], name, p, 64))})
    summary["pd_vs_colocated"] = results
    xfer = metrics_of(urls["decode"], "vllm:nixl_xfer_time_seconds_sum") / max(1, metrics_of(urls["decode"], "vllm:nixl_xfer_time_seconds_count"))
    summary["avg_transfer_ms"] = round(xfer * 1e3, 3)

    # 3. GSM8K through the router vs colocated.
    gsm = subprocess.run(
        cli("eval", "gsm8k", "--endpoint", urls["router"], "--baseline", urls["colocated"], "--limit", str(args.gsm8k_limit),
            "--max-tokens", "128", "--concurrency", "32", "--json", str(args.out / "gsm8k.json"), "--tolerance", "1"),  # fmt: skip
        capture_output=True, text=True, timeout=900,
    )
    summary["gsm8k_exit_code"] = gsm.returncode
    summary["gsm8k_report"] = gsm.stdout[-3000:]
    print(gsm.stdout[-3000:], gsm.stderr[-1500:], flush=True)


if __name__ == "__main__":
    sys.exit(main())
