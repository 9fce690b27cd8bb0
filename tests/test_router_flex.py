"""Flexible workers through the router: served whole as replicas, or in the roles the planner gives them (scripted workers)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.router.state import RouterState
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.traffic import WindowView
from hybrid_pd.sizing.workload import SLO, Lengths
from tests.router_support import KV, asgi_client, router_app

FLEX_A, FLEX_B = "http://flex-a.test:1", "http://flex-b.test:2"
H100_PROFILE = Path(__file__).parent.parent / "hybrid_pd/bench/results/2026-11-25-h100x2-sizing/profile.json"


class FlexWorkers:
    """Two scripted kv_both workers: a prefill leg gets state to pull, any other request a decoded answer (with its usage
    unless ``usage`` is False). Their tokenizer counts ``tokens_per_estimate`` tokens for each the router estimates from the
    text (4 bytes a token), in the answers' usage and on ``/tokenize`` (those asks kept in ``tokenized``)."""

    def __init__(self, tokens_per_estimate: float = 1.0, usage: bool = True) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.tokenized: list[dict] = []
        self.tokens_per_estimate = tokens_per_estimate
        self.usage = usage

    def count(self, prompt: object) -> int:
        if isinstance(prompt, list):  # token ids: as many as there are
            return len(prompt)
        return max(1, round(len(str(prompt).encode()) // 4 * self.tokens_per_estimate))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            self.tokenized.append(body)
            return httpx.Response(200, json={"count": self.count(body["prompt"]), "max_model_len": 4096, "tokens": []})
        self.calls.append((request.url.host, body))
        prompt = self.count(body.get("prompt", ""))
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            usage = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "P"}], "usage": usage, "kv_transfer_params": KV})
        usage = {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}
        return httpx.Response(200, json={"choices": [{"index": 0, "text": " decoded"}], **({"usage": usage} if self.usage else {})})


def _counter(text: str, name: str, reason: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f'{name}{{reason="{reason}"}}'))
    return float(line.rsplit(" ", 1)[1])


@contextlib.asynccontextmanager
async def _router(workers: FlexWorkers, **settings: object) -> AsyncIterator[tuple[httpx.AsyncClient, RouterState]]:
    """A running router in front of the two flex workers, both admitted; its client and state."""
    app = router_app(workers, prefill=[], decode=[], flex=[FLEX_A, FLEX_B], **settings)
    state = app.state.router
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        for worker in state.registry.all():
            state.registry.record_health(worker, ok=True)
        yield client, state


async def test_flexible_workers_serve_whole_requests_as_replicas():
    workers = FlexWorkers()
    async with _router(workers) as (client, _):
        body = {"model": "m", "prompt": "x" * 4000, "max_tokens": 3}
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(4)))
        assert [(r.status_code, r.json()["choices"][0]["text"]) for r in answers] == [(200, " decoded")] * 4
        metrics = (await client.get("/metrics")).text
    assert not [b for _, b in workers.calls if "kv_transfer_params" in b]  # no leg of either kind: colocated requests
    assert {host for host, _ in workers.calls} == {"flex-a.test", "flex-b.test"}  # both serve at once, as replicas
    assert _counter(metrics, "hybrid_pd_fallbacks_total", "replica") == 4
    assert _counter(metrics, "hybrid_pd_disaggregated_total", "planner") == 0
    assert "hybrid_pd_planner_prefill_workers 0.0" in metrics


async def test_in_the_planners_roles_one_flex_worker_prefills_and_the_other_pulls_the_state():
    workers = FlexWorkers()
    async with _router(workers) as (client, state):
        state.planner.apply({FLEX_A: "decode", FLEX_B: "prefill"}, "test")
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 4000, "max_tokens": 3})
        metrics = (await client.get("/metrics")).text
        shown = (await client.get("/planner")).json()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " decoded"
    (prefill_host, prefill), (decode_host, decode) = workers.calls
    assert (prefill_host, decode_host) == ("flex-b.test", "flex-a.test")
    assert prefill["kv_transfer_params"]["do_remote_decode"] and decode["kv_transfer_params"]["remote_engine_id"] == KV["remote_engine_id"]
    assert r.json()["usage"]["prompt_tokens"] == 1000 and _counter(metrics, "hybrid_pd_disaggregated_total", "planner") == 1
    assert "hybrid_pd_planner_prefill_workers 1.0" in metrics and "hybrid_pd_planner_moves_total 1.0" in metrics
    assert shown["layout"] == "1P1D" and shown["roles"] == {FLEX_A: "decode", FLEX_B: "prefill"}


async def test_under_a_split_prompts_outside_the_planners_bounds_go_whole_to_any_worker():
    """Roles sized for prompts of 500-8000 tokens: such a prompt is split as the roles say; shorter ones and longer ones are
    served whole, on the prefiller too (the decoder is busier): not all decoded by the one decoder, nor all prefilled by the one
    prefiller."""
    workers = FlexWorkers()
    async with _router(workers) as (client, state):
        state.planner.apply({FLEX_A: "decode", FLEX_B: "prefill"}, "test", Lengths(500, 8000))
        state.registry.by_url(FLEX_A).load.decodes = 5
        long = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 4000, "max_tokens": 3})
        split = list(workers.calls)
        workers.calls.clear()
        short = await asyncio.gather(*(client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3}) for _ in range(2)))
        whole_short = list(workers.calls)
        workers.calls.clear()
        longer = await asyncio.gather(*(client.post("/v1/completions", json={"model": "m", "prompt": "x" * 40000, "max_tokens": 3}) for _ in range(2)))
        shown = (await client.get("/planner")).json()
    assert long.status_code == 200 and [host for host, _ in split] == ["flex-b.test", "flex-a.test"]  # B prefilled, A decoded
    for answers, calls in ((short, whole_short), (longer, workers.calls)):
        assert [r.status_code for r in answers] == [200, 200] and not [b for _, b in calls if "kv_transfer_params" in b]
        assert "flex-b.test" in {host for host, _ in calls}  # the prefiller served one whole
    assert shown["split_prompts"] == [500, 8000]


async def test_the_split_bounds_are_in_the_tokens_the_workers_count_not_the_routers_estimate():
    """The planner sizes, and bounds its split, in the tokens the workers count; the router estimates a request from its text
    at 4 bytes a token. A tokenizer of 2 bytes a token (the GPU run's, about): a prompt of 4000 bytes, estimated 1000, counts
    2000, inside roles sized for 1500-3000, and is split (compared raw, 1000 < 1500: served whole, as every document was on
    four GPUs)."""
    workers = FlexWorkers(tokens_per_estimate=2.0)
    async with _router(workers) as (client, state):
        first = await client.post("/v1/completions", json={"model": "m", "prompt": "y" * 4000, "max_tokens": 3})  # its usage sets the ratio
        assert first.status_code == 200 and first.json()["usage"]["prompt_tokens"] == 2000
        state.planner.apply({FLEX_A: "decode", FLEX_B: "prefill"}, "test", Lengths(1500, 3000))
        workers.calls.clear()
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 4000, "max_tokens": 3})
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 200 and [host for host, _ in workers.calls] == ["flex-b.test", "flex-a.test"]  # B prefilled, A decoded
    assert _counter(metrics, "hybrid_pd_disaggregated_total", "planner") == 1


async def test_a_prompt_of_token_ids_is_bounded_by_its_length_not_the_texts_ratio():
    """Text counting 2 tokens per estimated one sets the ratio; a prompt of 2000 token ids is 2000 tokens, inside roles sized
    for 1500-3000, and is split (scaled like text, 4000: served whole)."""
    workers = FlexWorkers(tokens_per_estimate=2.0)
    async with _router(workers) as (client, state):
        await client.post("/v1/completions", json={"model": "m", "prompt": "y" * 4000, "max_tokens": 3})  # the ratio: 2
        state.planner.apply({FLEX_A: "decode", FLEX_B: "prefill"}, "test", Lengths(1500, 3000))
        workers.calls.clear()
        r = await client.post("/v1/completions", json={"model": "m", "prompt": list(range(2000)), "max_tokens": 3})
    assert state.planner.traffic.prompt_ratio == 2.0
    assert r.status_code == 200 and [host for host, _ in workers.calls] == ["flex-b.test", "flex-a.test"]  # B prefilled, A decoded


async def test_a_worker_counts_a_prompt_when_none_was_lately_so_the_planner_sizes_right_before_any_answer(tmp_path):
    """An answer's usage tells the tokens only when it ends. A router that counted no prompt in the last period has a worker
    count the next text prompt (vLLM's ``/tokenize``), off the request's path: with answers that tell no usage at all, the
    window's estimates are corrected after the first text request (2 tokens per estimated one). A prompt of token ids needs
    no count and does not use up the period's; a second text prompt within the period is not counted again."""
    workers = FlexWorkers(tokens_per_estimate=2.0, usage=False)
    app, _ = _four_flex_planner(tmp_path, workers, planner_interval_s=30.0)
    state = app.state.router
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        for worker in state.registry.all():
            state.registry.record_health(worker, ok=True)
        answers = [await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 3})
                   for prompt in ([1, 2, 3], "x" * 4000, "y" * 8000)]  # fmt: skip
        deadline = time.perf_counter() + 10
        while state.planner.traffic.prompt_ratio == 1.0 and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        corrected, shown = state.planner.traffic.prompt_tokens(1000), (await client.get("/planner")).json()
    assert [r.status_code for r in answers] == [200] * 3 and answers[1].json()["usage"] is None
    assert workers.tokenized == [{"model": "m", "prompt": "x" * 4000}]
    assert corrected == 2000 and shown["prompt_tokens_per_estimate"] == 2.0


def _four_flex_planner(tmp_path: Path, workers: object, **settings: object) -> tuple[object, list[str]]:
    """A router over four flexible workers with the planner (the four-H100 profile, 14 GiB of cache, 500/20 ms unless
    ``settings`` say otherwise, a look every 0.2 s over 10 s) and the workers' URLs."""
    flex = [f"http://flex-{i}.test:{i + 1}" for i in range(4)]
    profile = tmp_path / "profile.json"
    Profile.load(H100_PROFILE).model_copy(update={"cache_bytes": 14 << 30}).save(profile)
    settings = {"slo_ttft_ms": 500.0, "slo_tpot_ms": 20.0, "planner_profile": str(profile), "planner_interval_s": 0.2,
                "planner_window_s": 10.0, **settings}  # fmt: skip
    return router_app(workers, prefill=[], decode=[], flex=flex, **settings), flex


def _chat_in_flight(traffic: object, now: float, in_flight: int, slo: SLO | None = None) -> None:
    """``in_flight`` requests of 1000/512 tokens in the window since 10 s ago, and a closed loop's last 3.2 s: each one that
    ends is followed by the next (half of them)."""
    for _ in range(in_flight):
        traffic.started(now - 10, 1000, 512, slo)
    for i in range(in_flight // 2):
        at = now - 5 + i * 6.4 / in_flight
        traffic.ended(at, 1000, 512, 1000, 512)
        traffic.started(at, 1000, 512, slo)


async def test_the_planner_moves_roles_from_the_traffic_it_measured(tmp_path):
    """1000/512-token requests, 128 in flight, on four flexible workers under 500/20 ms: the simulator puts 1P3D first
    (docs/sizing.md), and the planner gives one worker, the one decoding fewest, the prefills."""
    app, flex = _four_flex_planner(tmp_path, FlexWorkers())
    state = app.state.router
    async with app.router.lifespan_context(app):
        for i, worker in enumerate(state.registry.all()):
            state.registry.record_health(worker, ok=True)
            worker.load.decodes = 40 - i  # the last one decodes fewest
        _chat_in_flight(state.planner.traffic, time.perf_counter(), 128)
        deadline = time.perf_counter() + 60  # the decision's process starts first
        while state.planner.moves == 0 and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
        shown = state.planner.snapshot()
    assert shown["layout"] == "1P3D", shown
    assert shown["roles"] == {flex[0]: "decode", flex[1]: "decode", flex[2]: "decode", flex[3]: "prefill"}
    assert {p["layout"] for p in shown["predictions"]} == {"4 flex", "1P3D", "2P2D", "3P1D"}


async def test_a_request_asks_for_its_slo_in_headers_and_a_bad_one_is_refused():
    """llm-d's ``x-slo-ttft-ms`` and ``x-slo-tpot-ms``: what a request asks for is what the planner's window keeps (a target
    left out: the router's own); a target that is not a number of milliseconds above 0 is the client's error."""
    app = router_app(FlexWorkers(), prefill=[], decode=[], flex=[FLEX_A, FLEX_B], slo_ttft_ms=500.0, slo_tpot_ms=20.0)
    state = app.state.router
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        for worker in state.registry.all():
            state.registry.record_health(worker, ok=True)
        body = {"model": "m", "prompt": "hi", "max_tokens": 3}
        asked = [await client.post("/v1/completions", json=body, headers=headers)
                 for headers in ({"x-slo-ttft-ms": "4000", "x-slo-tpot-ms": "15"}, {"x-slo-tpot-ms": "12.5"}, {})]  # fmt: skip
        seen = [slo for _, _, _, slo in state.planner.traffic.view(time.perf_counter()).arrived]
        bad = [await client.post("/v1/completions", json=body, headers={name: value})
               for name, value in (("x-slo-ttft-ms", "soon"), ("x-slo-tpot-ms", "0"), ("x-slo-ttft-ms", "inf"))]  # fmt: skip
    assert [r.status_code for r in asked] == [200] * 3 and seen == [SLO(4000, 15), SLO(500, 12.5), SLO(500, 20)]
    assert [r.status_code for r in bad] == [400] * 3 and all(r.json()["error"]["message"].startswith("header x-slo-") for r in bad)
    assert len(state.planner.traffic.view(time.perf_counter()).arrived) == 3  # a refused request is no traffic


async def test_the_planner_sizes_for_the_slo_the_requests_asked_for(tmp_path):
    """The router's own targets are 500/20 ms, under which 128 in flight of 1000/512 are best on 1P3D
    (test_the_planner_moves_roles_from_the_traffic_it_measured); the requests ask for 4000/15, under which whole requests are best (the four-H100 profile): they stay whole."""
    app, _ = _four_flex_planner(tmp_path, FlexWorkers())
    state = app.state.router
    async with app.router.lifespan_context(app):
        for worker in state.registry.all():
            state.registry.record_health(worker, ok=True)
        _chat_in_flight(state.planner.traffic, time.perf_counter(), 128, SLO(4000, 15))
        deadline = time.perf_counter() + 60  # the decision's process starts first
        while state.planner.decision is None and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
        shown = state.planner.snapshot()
    assert shown["layout"] == "4 flex" and "at 4000/15 ms" in shown["why"], shown


def _routers(workers: FlexWorkers, apps: dict[str, object]) -> Callable[[httpx.Request], Awaitable[httpx.Response]]:
    """The network of several routers and their workers: ``http://NAME.test`` reaches ``apps[NAME]`` (filled in later)."""

    async def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.host.removesuffix(".test")
        if name in apps:
            async with asgi_client(apps[name]) as client:
                answer = await client.get(request.url.path)
            return httpx.Response(answer.status_code, content=answer.content, headers={"content-type": "application/json"})
        return workers(request)

    return handler


async def test_a_router_without_a_profile_takes_the_roles_of_its_peer_that_decides(tmp_path):
    workers, apps = FlexWorkers(), {}
    profile = tmp_path / "profile.json"
    Profile.load(H100_PROFILE).save(profile)
    leader = apps["leader"] = router_app(workers, prefill=[], decode=[], flex=[FLEX_A, FLEX_B], planner_profile=str(profile))
    follower = router_app(_routers(workers, apps), prefill=[], decode=[], flex=[FLEX_A, FLEX_B], planner_peers=["http://leader.test:9"],
                          planner_interval_s=0.05)  # fmt: skip
    async with leader.router.lifespan_context(leader), follower.router.lifespan_context(follower):
        for app in (leader, follower):
            for worker in app.state.router.registry.all():
                app.state.router.registry.record_health(worker, ok=True)
        leader.state.router.planner.apply({FLEX_A: "prefill", FLEX_B: "decode"}, "test")
        deadline = time.perf_counter() + 10
        while follower.state.router.pairing.roles != leader.state.router.pairing.roles and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        async with asgi_client(follower) as client:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "x" * 4000, "max_tokens": 3})
            shown = (await client.get("/planner")).json()
    assert follower.state.router.pairing.roles == {FLEX_A: "prefill", FLEX_B: "decode"}
    assert r.status_code == 200 and [host for host, _ in workers.calls] == ["flex-a.test", "flex-b.test"]  # A prefilled, B decoded
    assert shown["leader"] == leader.state.router.planner.id and not shown["leads"]


async def test_two_routers_agree_the_one_up_longest_decides_for_the_traffic_of_both(tmp_path):
    """Each router has half of 128 requests in flight of 1000/512 tokens, on four flexible workers under 500/20 ms. Alone, 64
    in flight, whole requests are best (the four-H100 matrix); together, 1P3D. Both have the profile: the older decides from
    the merged traffic, the other takes its roles (deciding alone, it would keep whole requests)."""
    workers, apps = FlexWorkers(), {}
    network = _routers(workers, apps)
    for name, peer in (("a", "b"), ("b", "a")):
        apps[name], _ = _four_flex_planner(tmp_path, network, planner_peers=[f"http://{peer}.test:9"])
    a, b = (apps[n].state.router for n in "ab")
    a.planner.id, b.planner.id = "1-a", "2-b"  # a started first
    async with contextlib.AsyncExitStack() as stack:
        for app in apps.values():
            await stack.enter_async_context(app.router.lifespan_context(app))
        now = time.perf_counter()
        for state in (a, b):
            for i, worker in enumerate(state.registry.all()):
                state.registry.record_health(worker, ok=True)
                worker.load.decodes = 40 - i
            _chat_in_flight(state.planner.traffic, now, 64)
        deadline = time.perf_counter() + 60  # the decisions' processes start first
        while (a.planner.moves == 0 or b.pairing.roles != a.pairing.roles) and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
        shown = {name: (await _get(apps[name], "/planner")) for name in "ab"}
    assert shown["a"]["layout"] == shown["b"]["layout"] == "1P3D", shown
    assert shown["a"]["leads"] and not shown["b"]["leads"] and shown["b"]["leader"] == "1-a"
    assert b.planner.decision is None  # b never decided: a, up longer, did


async def _get(app: object, path: str) -> dict:
    async with asgi_client(app) as client:
        return (await client.get(path)).json()


def test_the_planners_settings_are_checked():
    with pytest.raises(ValueError, match="no profile 'p.json'"):
        RouterSettings(flex=["http://f:1"], planner_profile="p.json")
    assert RouterSettings(planner_profile="nemotron-h-8b-h100").slo_ttft_ms is None  # a shipped profile, no targets: no bound
    with pytest.raises(ValueError, match="must start with http"):
        RouterSettings(planner_peers=["router-admin:8000"])


def test_flex_urls_are_checked_like_the_others():
    assert RouterSettings(flex=["http://f:1/"]).flex == ["http://f:1"]


def test_a_peers_window_this_router_cannot_read_is_left_out_not_the_whole_look():
    """A peer of another version shares a window of another shape: the leader sizes for the others' traffic (before, the
    look failed and no role moved while that peer ran)."""
    from hybrid_pd.router.peer_wire import window_json, window_of

    # a peer from before arrivals carried their SLO pair: none asked
    assert window_of({"arrived": [[1.5, 1000, 512]], "inflight": [[2.0, 3]]}) == WindowView(((1.5, 1000, 512, None),), ((2.0, 3),))
    shared = WindowView(((1.5, 1000, 512, SLO(500, 20)), (1.0, 900, 500, SLO(500, float("inf"))), (0.5, 80, 8, None)), ((2.0, 3),))
    assert json.loads(json.dumps(window_json(shared), allow_nan=False)) is not None and window_of(window_json(shared)) == shared
    for window in (None, [], {"arrived": [[1.5, "many", 512]], "inflight": []}, {"arrived": [[1.5, 1000]], "inflight": []}, {"inflight": []},
                   {"arrived": [[1.5, 1000, 512, 500]], "inflight": []}):  # fmt: skip
        assert window_of(window) is None, window
