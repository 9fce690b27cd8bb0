"""Heterogeneous TP on GPUs: prefill TP=2 -> decode TP=1 and prefill TP=1 -> decode TP=2.

Run on a machine with two NVIDIA GPUs and vLLM + NIXL installed (see deploy/gpu/README.md):

    python deploy/gpu/hetero_tp_check.py --out results/ [--prompts 4]

Starts, through ``hybrid-pd prefill|decode|colocated``, a TP=2 prefill and a TP=2
decode worker (both GPUs), a TP=1 prefill (GPU 0), a TP=1 decode (GPU 1) and a
colocated TP=1 server (GPU 1) on the random-weight hybrid of ``pd_check.py``. Each
direction runs vLLM's NIXL pull protocol directly (prefill leg, then decode leg with
its ``kv_transfer_params``) and is compared, greedy, with the colocated server; the
decode worker's NIXL counters give the transfers per request. Writes ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from deploy.gpu.pd_check import cli, compare, gpu_model, metrics_of, wait_all_ready  # noqa: E402
from services.common.processes import free_port, spawn, stop_group  # noqa: E402
from services.router.legs import decode_body, prefill_body  # noqa: E402

# name -> (role, tensor-parallel size, CUDA_VISIBLE_DEVICES)
WORKERS = {
    "prefill_tp2": ("prefill", 2, "0,1"),
    "decode_tp2": ("decode", 2, "0,1"),
    "prefill_tp1": ("prefill", 1, "0"),
    "decode_tp1": ("decode", 1, "1"),
    "colocated": ("colocated", 1, "1"),
}
DIRECTIONS = {"prefill_tp2_to_decode_tp1": ("prefill_tp2", "decode_tp1"), "prefill_tp1_to_decode_tp2": ("prefill_tp1", "decode_tp2")}


def pd(prefill: str, decode: str, body: dict) -> dict:
    """One request over vLLM's NIXL pull protocol, the way the router makes its two legs."""
    with httpx.Client(timeout=300) as client:
        first = client.post(prefill + "/v1/completions", json=prefill_body(body))
        first.raise_for_status()
        answer = client.post(decode + "/v1/completions", json=decode_body(body, first.json()["kv_transfer_params"]))
        answer.raise_for_status()
    return answer.json()["choices"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = gpu_model()
    name = "hybrid-gpu"
    urls, procs = {}, {}
    started = time.monotonic()
    for worker, (role, tp, gpus) in WORKERS.items():
        port = free_port()
        argv = cli(role, "--model", str(model_dir), "--served-model-name", name, "--device", "cuda", "--port", str(port),
                   "--tensor-parallel-size", str(tp), "--max-model-len", "4096", "--max-num-seqs", "16",
                   "--gpu-memory-utilization", "0.15", "--kv-cache-memory-bytes", str(4 << 30))  # fmt: skip
        if role != "colocated":
            argv += ["--side-channel-port", str(free_port())]
        procs[worker] = spawn(argv, env={"CUDA_VISIBLE_DEVICES": gpus}, log=args.out / f"{worker}.log")
        urls[worker] = f"http://127.0.0.1:{port}"
    summary: dict = {"workers": {w: {"role": r, "tp": tp, "gpus": g} for w, (r, tp, g) in WORKERS.items()}}
    try:
        summary["ready_s"] = wait_all_ready(procs, urls, args.out, started)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        body = {"model": name, "max_tokens": 32, "temperature": 0, "logprobs": 2, "return_token_ids": True, "ignore_eos": True}
        for direction, (prefill, decode) in DIRECTIONS.items():
            pd(urls[prefill], urls[decode], {**body, "prompt": "warm up " * 20})  # first handshake with a new peer
            results = []
            for i in range(args.prompts):
                prompt = [(31 * j + 7 * i) % (vocab - 20) + 10 for j in range(200 + 300 * i)]
                before = metrics_of(urls[decode], "vllm:nixl_xfer_time_seconds_count")
                routed = pd(urls[prefill], urls[decode], {**body, "prompt": prompt})
                time.sleep(1)
                transfers = metrics_of(urls[decode], "vllm:nixl_xfer_time_seconds_count") - before
                baseline = httpx.post(urls["colocated"] + "/v1/completions", json={**body, "prompt": prompt}, timeout=300).json()["choices"][0]
                results.append({"prompt_tokens": len(prompt), "transfers": transfers, **compare(routed, baseline)})
            summary[direction] = results
            print(direction, json.dumps(results), flush=True)
    finally:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        for proc in procs.values():
            stop_group(proc, grace_s=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
