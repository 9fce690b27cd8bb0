"""What a prefill costs vLLM 0.26 with prefix caching on (Mamba cache mode ``all``), by the length of its prefix hit.

For each server (``NAME=URL``), at 1 request in flight unless ``--together`` says otherwise: a prompt that resumes ``hit``
tokens from the prefix cache (a first request of ``hit + 1`` tokens left them there: states at every block up to
``hit``) and computes ``tail`` more, ``max_tokens`` 1. Per case: the client's latency (the whole answer: one token) and
vLLM's own means over the case from its /metrics (``request_prefill_time``: scheduled -> first token, and queue time).
``--together K``: K such requests sent at once (their prefills share steps). A server with caching off computes
``hit + tail`` tokens every time (nothing to resume): the same prompts, the cost of the tokens alone.

    python3 probe_hits.py --server on=http://127.0.0.1:8100 --server off=http://127.0.0.1:8101 --block 1152 --out hits.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from hybrid_pd.common.prom import histogram_mean, metric_sum

HISTOGRAMS = ("vllm:request_prefill_time_seconds", "vllm:request_queue_time_seconds", "vllm:time_to_first_token_seconds")


def means(before: str, after: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in HISTOGRAMS:
        observed = histogram_mean(before, after, name)
        out[name.removeprefix("vllm:").removesuffix("_seconds") + "_ms"] = observed[0] * 1e3 if observed else None
    out["hit_tokens"] = metric_sum(after, "vllm:prefix_cache_hits_total") - metric_sum(before, "vllm:prefix_cache_hits_total")
    return out


def one(client: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return (time.perf_counter() - started) * 1e3


def case(client: httpx.Client, url: str, model: str, rng: random.Random, hit: int, tail: int, together: int, reps: int, vocab: int) -> dict:
    """``reps`` times: ``together`` prompts resuming ``hit`` tokens and computing ``tail`` more, sent at once."""
    latencies: list[float] = []
    server: list[dict[str, float | None]] = []
    for _ in range(reps):
        prefixes = [[rng.randrange(10, vocab - 10) for _ in range(hit + 1)] for _ in range(together)]
        if hit:  # leave each prefix's states in the cache; not measured
            for p in prefixes:
                one(client, url, model, p)
        prompts = [p[:hit] + [rng.randrange(10, vocab - 10) for _ in range(tail)] for p in prefixes]
        before = client.get(f"{url}/metrics").text
        with ThreadPoolExecutor(together) as pool:
            latencies += list(pool.map(lambda p: one(client, url, model, p), prompts))
        server.append(means(before, client.get(f"{url}/metrics").text))
    keys = [k for k in server[0] if k != "hit_tokens"]
    return {"hit": hit, "tail": tail, "together": together, "requests": len(latencies), "client_ms_p50": statistics.median(latencies),
            "client_ms_mean": statistics.fmean(latencies),
            **{k: statistics.fmean(v) if (v := [r[k] for r in server if r[k] is not None]) else None for k in keys},
            "hit_tokens_per_request": sum(r["hit_tokens"] or 0 for r in server) / len(latencies)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", action="append", required=True, help="NAME=URL")
    ap.add_argument("--model", default="nemotron-h-8b")
    ap.add_argument("--block", type=int, required=True, help="the engine's attention block (where hits land)")
    ap.add_argument("--tails", default="200,800")
    ap.add_argument("--hits", default="0,1,2,3", help="hits in blocks")
    ap.add_argument("--together", default="1,4")
    ap.add_argument("--together-hits", default="0,2", help="hits in blocks of the cases with more than one request at once")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=4096, help="the servers': longer cases are left out")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = []
    with httpx.Client(timeout=120) as client:
        for spec in args.server:
            name, url = spec.split("=", 1)
            rng = random.Random(name)
            for _ in range(3):  # warm
                one(client, url, args.model, [rng.randrange(10, args.vocab - 10) for _ in range(args.block + 300)])
            for together in map(int, args.together.split(",")):
                for blocks in map(int, (args.hits if together == 1 else args.together_hits).split(",")):
                    for tail in map(int, args.tails.split(",")):
                        if (together > 1 and tail != int(args.tails.split(",")[0])) or blocks * args.block + tail >= args.max_model_len:
                            continue
                        row = {"server": name, **case(client, url, args.model, rng, blocks * args.block, tail, together, args.reps if together == 1 else 3, args.vocab)}
                        results.append(row)
                        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
