"""What the multi-turn timeline run recorded (run.sh): per run, the client's figures, the decode pair's hand-off budget per
turn (the timeline), and each server's means from vLLM's own histograms over the run (its /metrics before and after);
then each ``vllm bench serve`` point (BENCH in run.sh), as vLLM's client reported it, with a pair's hand-off budget.

    python3 analyze.py DIR [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybrid_pd.bench.budget import budgets, format_budget
from hybrid_pd.common.prom import histogram_mean, metric_sum

# vLLM's histograms whose mean over a run says where a request's time went in that server (seconds)
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:nixl_xfer_time_seconds",
    "vllm:nixl_post_time_seconds",
    "vllm:nixl_bytes_transferred",
    "vllm:nixl_num_descriptors",
)
COUNTERS = ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total",
            "vllm:request_success_total")  # fmt: skip
SERVERS = ("pre", "presync", "dec", "flex0", "flex1")


def server_means(metrics: Path, run: str, server: str) -> dict[str, float]:
    try:
        before, after = ((metrics / f"{run}-{when}-{server}.txt").read_text() for when in ("before", "after"))
    except OSError:
        return {}
    out = {}
    for name in HISTOGRAMS:
        if (observed := histogram_mean(before, after, name)) is not None:
            out[f"{name.removeprefix('vllm:')} mean"], out[f"{name.removeprefix('vllm:')} n"] = observed
    for name in COUNTERS:
        out[name.removeprefix("vllm:")] = metric_sum(after, name) - metric_sum(before, name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    report = {}
    for path in sorted((args.dir / "mt").glob("*.json")):
        run = path.stem
        row = json.loads(path.read_text())
        s = row["summary"]
        print(f"== {run}: {s['requests']} requests ({s['failed']} failed), {s['throughput_req_s']:.2f} req/s, TTFT p50 first turns "
              f"{s['ttft_first_turn_ms']['p50']}, later {s['ttft_later_turns_ms']['p50']} ms, TPOT mean {s['tpot_mean_ms']} ms, cache {s.get('cache')}")
        entry = {"summary": s, "workload": row["workload"], "servers": {}, "budgets": {}}
        for server in SERVERS:
            means = server_means(args.dir / "metrics", run, server)
            if means.get("request_success_total"):
                entry["servers"][server] = means
                print(f"  {server}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" if k.endswith("seconds mean") else f"{k} {v:,.0f}" for k, v in means.items()))
        tag = run.removesuffix("-salted")
        prefix = f"{tag}-salted-turn" if run.endswith("-salted") else f"{tag}-turn"
        if (args.dir / "timeline").is_dir():
            for b in budgets(args.dir / "timeline", prefix):
                print(format_budget(b))
                entry["budgets"][b.group] = b.to_json()
        report[run] = entry
    for path in sorted((args.dir / "bench").glob("*.json")):  # vllm bench serve's results (BENCH in run.sh)
        b = json.loads(path.read_text())
        figures = {k: b.get(k) for k in ("completed", "request_throughput", "output_throughput", "request_goodput", "median_ttft_ms", "mean_ttft_ms",
                                          "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "median_itl_ms")}  # fmt: skip
        print(f"== bench {path.stem}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()))
        report[f"bench {path.stem}"] = figures
        if (args.dir / "timeline").is_dir():  # a pair's point: its requests' hand-off budget (run.sh's --request-id-prefix)
            for b in budgets(args.dir / "timeline", f"{path.stem}-"):
                print(format_budget(b))
                figures["budget"] = b.to_json(requests=False)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
