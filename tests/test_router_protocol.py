"""Protocol edge cases of the router against scripted workers (no vLLM: see tests/e2e for that)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hybrid_pd.connector.trace.timeline import REQUEST_ID_PARAM
from hybrid_pd.router.health import available_urls, listed_urls
from tests.router_support import DECODE, KV, PREFILL, Workers, asgi_client, router_app


async def test_both_legs_share_one_request_id_and_follow_the_pull_protocol(client, workers):
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8}, headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200
    (p_worker, p_body, p_headers), (d_worker, d_body, d_headers) = workers.calls
    assert (p_worker, d_worker) == ("prefill", "decode")
    assert p_headers["x-request-id"] == d_headers["x-request-id"] == "req-42"
    assert r.headers["x-request-id"] == "req-42"
    assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["kv_transfer_params"][REQUEST_ID_PARAM] == "req-42"  # the engines name their timeline events by it
    assert d_body == {"model": "m", "prompt": "hi", "max_tokens": 8, "kv_transfer_params": {**KV, REQUEST_ID_PARAM: "req-42"}}


async def test_request_id_is_generated_when_absent(client, workers):
    await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    ids = {headers["x-request-id"] for _, _, headers in workers.calls}
    assert len(ids) == 1 and len(ids.pop()) >= 16


async def test_answer_is_the_decode_answer_with_merged_usage(client):
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8})
    answer = r.json()
    assert answer["choices"][0]["text"] == " decoded"
    assert "PREFILL-TOKEN" not in r.text
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 2}}


async def test_stream_is_relayed_with_usage_rewritten(client, workers):
    workers.decode_stream = [
        b'data: {"choices":[{"index":0,"text":" a"}]}\n\n',
        b'data: {"choices":[{"index":0,"text":" b"}],"usage":null}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n',
        b"data: [DONE]\n\n",
    ]
    body = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == [" a", " b"]
    assert json.loads(events[2])["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    prefill_body = workers.calls[0][1]
    assert prefill_body["stream"] is False and "stream_options" not in prefill_body
    assert workers.calls[1][1]["stream"] is True


async def test_prefill_client_error_goes_back_unchanged_and_decode_is_not_called(client, workers):
    error = {"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError", "param": None, "code": 400}}
    workers.prefill_response = httpx.Response(400, json=error)
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": -1})
    assert r.status_code == 400 and r.json() == error
    assert [w for w, _, _ in workers.calls] == ["prefill"]
    assert [w.inflight for w in client._transport.app.state.router.registry.all()] == [0, 0]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
async def test_malformed_body_is_an_openai_400(client, workers, raw):
    r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert workers.calls == []


@pytest.mark.parametrize("failure", [httpx.ConnectError("connection refused"), httpx.Response(500, json={})])
async def test_failed_prefill_leg_falls_back_to_local_prefill_on_the_decode_worker(client, workers, failure):
    workers.prefill_response = failure
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert [w for w, _, _ in workers.calls] == ["prefill", "decode"]
    assert workers.calls[1][1] == body, "the decode worker gets the client's request without transfer params"
    metrics = (await client.get("/metrics")).text
    assert 'hybrid_pd_fallbacks_total{reason="prefill_failed"} 1.0' in metrics


async def test_decode_failing_mid_stream_ends_with_an_error_event(client, workers):
    workers.decode_stream = [b'data: {"choices":[{"index":0,"text":" a"}]}\n\n']
    workers.decode_breaks = True
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == " a"
    assert "decode worker failed mid-stream" in json.loads(events[1])["error"]["message"]
    assert events[-1] == "[DONE]"


async def test_models_come_from_a_decode_worker(client, workers):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["data"][0]["root"] == "/decode"


async def _router(workers: Workers, **settings):
    app = router_app(workers, **settings)
    return app, asgi_client(app)


async def test_api_keys_guard_the_public_endpoints(workers):
    app, c = await _router(workers, api_keys=["sk-1"])
    async with app.router.lifespan_context(app), c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (await c.get("/v1/models")).status_code == 401
        ok = await c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-1"})
        assert ok.status_code == 200


async def test_body_over_the_limit_is_413(workers):
    app, c = await _router(workers, max_body_bytes=1000)
    async with app.router.lifespan_context(app), c:
        r = await c.post("/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413 and "larger than 1000 bytes" in r.json()["error"]["message"]
        assert workers.calls == []


async def test_no_decode_worker_is_503_with_retry_after(workers):
    app, c = await _router(workers, decode=[])
    async with app.router.lifespan_context(app), c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"


async def test_decode_worker_at_its_limit_is_429_with_retry_after(workers):
    app, c = await _router(workers, max_concurrency_per_worker=1)
    async with app.router.lifespan_context(app), c:
        app.state.router.registry.role("decode")[0].inflight = 1
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"


async def test_decode_failing_before_its_first_byte_is_retried_once_on_another_worker(workers):
    other = "http://decode2.test:3"
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.host == "decode.test":
            seen.append("decode")
            raise httpx.ConnectError("refused")
        if request.method == "POST" and request.url.host == "decode2.test":
            seen.append("decode2")
        return workers(request)

    app = router_app(handler, decode=[DECODE, other], decode_policy="round_robin")
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 200 and seen == ["decode", "decode2"]
            assert [w for w, _, _ in workers.calls].count("prefill") == 2, "a new prefill leg for the new decode worker"
            assert "hybrid_pd_retries_total 1.0" in (await c.get("/metrics")).text


async def test_prompt_list_is_split_into_one_pair_per_prompt_and_merged_in_order(client, workers):
    r = await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "max_tokens": 3})
    assert r.status_code == 200
    prefill_prompts = [body["prompt"] for w, body, _ in workers.calls if w == "prefill"]
    assert sorted(prefill_prompts) == ["a", "b"]
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 6 and answer["usage"]["prompt_tokens"] == 10
    kv_params = [body.get("kv_transfer_params") for w, body, _ in workers.calls if w == "decode"]
    assert [{k: v for k, v in p.items() if k != REQUEST_ID_PARAM} for p in kv_params] == [KV, KV]
    assert len({p[REQUEST_ID_PARAM] for p in kv_params}) == 2  # each pair is a request of its own in the engines' timelines


async def test_n_choices_run_as_one_pair_each_seeded_as_vllm_seeds_them_with_each_prompt_counted_once(client, workers):
    r = await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 5, "max_tokens": 3})
    assert r.status_code == 200
    legs = sorted((w, body["prompt"], body["n"], body["seed"]) for w, body, _ in workers.calls)
    assert legs == sorted((w, p, 1, s) for w in ("prefill", "decode") for p in "ab" for s in (5, 6))
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert answer["usage"]["prompt_tokens"] == 10 and answer["usage"]["completion_tokens"] == 12
    workers.calls.clear()
    r = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 3})
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert [(w, "seed" in body, body["n"]) for w, body, _ in workers.calls].count(("prefill", False, 1)) == 3


async def test_more_choices_than_the_router_takes_in_flight_is_a_400_and_a_malformed_n_goes_to_vllm(workers):
    app, c = await _router(workers, max_concurrency=4)
    async with app.router.lifespan_context(app), c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": ["a", "b", "c"], "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert workers.calls == []
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "a", "n": 2, "temperature": 0})
        assert r.status_code == 400 and r.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."
        for n in (0, "2", True, 1.5):
            assert (await c.post("/v1/completions", json={"model": "m", "prompt": "a", "n": n})).status_code == 200
        assert [body["n"] for w, body, _ in workers.calls if w == "prefill"] == [0, "2", True, 1.5]


async def test_short_prompts_skip_the_prefill_leg_when_configured(workers):
    app, c = await _router(workers, local_prefill_below_tokens=100)
    async with app.router.lifespan_context(app), c:
        assert (await c.post("/v1/completions", json={"prompt": [1, 2, 3]})).status_code == 200
        assert [w for w, _, _ in workers.calls] == ["decode"]
        assert 'hybrid_pd_fallbacks_total{reason="short_prompt"} 1.0' in (await c.get("/metrics")).text


async def test_admin_api_is_off_without_a_token_and_guarded_with_one(workers):
    app, c = await _router(workers)
    async with app.router.lifespan_context(app), c:
        assert (await c.get("/admin/workers")).status_code == 404
    app, c = await _router(workers, admin_token="secret")
    async with app.router.lifespan_context(app), c:
        assert (await c.get("/admin/workers")).status_code == 401
        listed = await c.get("/admin/workers", headers={"Authorization": "Bearer secret"})
        assert {w["role"] for w in listed.json()["workers"]} == {"prefill", "decode"}


async def test_registration_refuses_a_prefill_worker_that_speculates_otherwise_than_the_decode_worker(workers):
    auth = {"Authorization": "Bearer secret"}
    mtp = '{"method":"mtp","num_speculative_tokens":%d}'
    app, c = await _router(workers, admin_token="secret", prefill=[])
    async with app.router.lifespan_context(app), c:
        registry = app.state.router.registry
        registry.role("decode")[0].identity = registry.role("decode")[0].identity.__class__(role="decode", model="m", speculative_config=mtp % 3)
        for other in ("none", mtp % 1):
            bad = {"url": "http://p.test:9", "role": "prefill", "identity": {"model": "m", "speculative_config": other}}
            r = await c.post("/admin/workers", json=bad, headers=auth)
            assert r.status_code == 409 and r.json()["error"]["param"] == "speculative_config", r.text
            assert "--speculative-config" in r.json()["error"]["message"]
        same = {"url": "http://p.test:9", "role": "prefill", "identity": {"model": "m", "speculative_config": mtp % 3}}
        assert (await c.post("/admin/workers", json=same, headers=auth)).status_code == 201


async def test_registration_refuses_an_incompatible_worker_naming_the_field(workers):
    auth = {"Authorization": "Bearer secret"}
    app, c = await _router(workers, admin_token="secret", prefill=[])
    async with app.router.lifespan_context(app), c:
        registry = app.state.router.registry
        registry.role("decode")[0].identity = registry.role("decode")[0].identity.__class__(role="decode", model="m", block_size=128)
        bad = {"url": "http://p.test:9", "role": "prefill", "identity": {"model": "m", "block_size": 16}}
        r = await c.post("/admin/workers", json=bad, headers=auth)
        assert r.status_code == 409 and r.json()["error"]["param"] == "block_size"
        good = {**bad, "identity": {"model": "m", "block_size": 128, "conv_state_layout": "DS"}}
        r = await c.post("/admin/workers", json=good, headers=auth)
        assert r.status_code == 201
        worker_id = r.json()["id"]
        assert (await c.post(f"/admin/workers/{worker_id}/drain", headers=auth)).json()["state"] == "draining"
        assert (await c.delete(f"/admin/workers/{worker_id}", headers=auth)).status_code == 200
        assert (await c.delete(f"/admin/workers/{worker_id}", headers=auth)).status_code == 404
        assert (await c.post("/admin/workers", json={"url": "ftp://x", "role": "prefill"}, headers=auth)).status_code == 400


async def test_requests_follow_workers_drained_registered_and_removed_through_the_admin_api(workers):
    auth = {"Authorization": "Bearer secret"}
    decode_hosts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.host != "prefill.test":
            decode_hosts.append(request.url.host)
        return workers(request)

    app = router_app(handler, decode=[DECODE, "http://decode2.test:3"], decode_policy="round_robin", admin_token="secret")
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as c:

            async def hosts_of_four_requests() -> set[str]:
                decode_hosts.clear()
                for _ in range(4):
                    assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
                return set(decode_hosts)

            assert await hosts_of_four_requests() == {"decode.test", "decode2.test"}
            listed = (await c.get("/admin/workers", headers=auth)).json()["workers"]
            second = next(w["id"] for w in listed if w["url"] == "http://decode2.test:3")
            assert (await c.post(f"/admin/workers/{second}/drain", headers=auth)).status_code == 200
            assert await hosts_of_four_requests() == {"decode.test"}
            joined = await c.post("/admin/workers", json={"url": "http://decode3.test:4", "role": "decode", "identity": {"model": "m"}}, headers=auth)
            assert joined.status_code == 201
            assert await hosts_of_four_requests() == {"decode.test", "decode3.test"}
            assert (await c.delete(f"/admin/workers/{joined.json()['id']}", headers=auth)).status_code == 200
            assert await hosts_of_four_requests() == {"decode.test"}


async def test_unknown_route_and_method_are_openai_errors(client):
    r = await client.post("/v1/embeddings", json={})
    assert r.status_code == 404 and "error" in r.json()
    r = await client.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


async def test_health_is_503_until_a_decode_worker_is_available_and_requests_recheck_evicted_workers(client, workers):
    app_state = client._transport.app.state.router
    decode = app_state.registry.role("decode")[0]
    for _ in range(3):
        app_state.registry.record_health(decode, ok=False)
    assert not decode.available
    r = await client.get("/health")
    assert r.status_code == 503
    assert r.json()["available"] == {"prefill": [PREFILL], "decode": [], "flex": []}
    # What callers waiting for every worker read (hybrid_pd.router.health): listed, but not all routed to.
    assert (listed_urls(r.json()), available_urls(r.json())) == ({PREFILL, DECODE}, {PREFILL})
    # The worker answers its health check again: a request re-checks at once instead of answering 503.
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 200 and decode.available
    r = await client.get("/health")
    assert r.status_code == 200 and r.json()["available"] == {"prefill": [PREFILL], "decode": [DECODE], "flex": []}


async def test_a_mixed_prompt_list_is_not_split(client, workers):
    await client.post("/v1/completions", json={"model": "m", "prompt": ["a", [1, 2]]})
    assert [body["prompt"] for w, body, _ in workers.calls if w == "prefill"] == [["a", [1, 2]]]


@pytest.mark.parametrize("body", [b'{"model": "m", "prompt": Infinity}', b'{"model": "m", "prompt": "hi", "temperature": NaN}',
                                  b'{"model": "m", "prompt": "hi", "max_tokens": 1e999}'])  # fmt: skip
async def test_nan_and_infinity_are_refused_as_invalid_json(client, workers, body):
    r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert workers.calls == []


async def test_a_streamed_prompt_list_is_relayed_as_one_answer(client, workers):
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n'
    workers.decode_stream = [b'data: {"choices":[{"index":0,"text":" a"}]}\n\n', usage, b"data: [DONE]\n\n"]
    body = {"model": "m", "prompt": ["x", "y"], "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"]) == [0, 1]
    assert [c["usage"]["total_tokens"] for c in chunks if "usage" in c] == [14]
    assert [w.inflight for w in client._transport.app.state.router.registry.all()] == [0, 0]


async def test_requests_whose_prefills_run_at_once_go_to_different_decode_workers():
    """The decode worker is counted from when it is chosen: requests that arrive while the first one's prefill runs
    must see it busy. Before, its lease began with the decode leg, and every request of a burst picked the same one."""
    second_decode = "http://decode-b.test:3"
    prefills_in = asyncio.Event()
    waiting = 0
    decoded_on: list[str] = []
    answer = {"choices": [{"index": 0, "text": " decoded"}], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal waiting
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]} if request.url.path == "/v1/models" else {})
        if request.url.host == "prefill.test":
            waiting += 1
            if waiting == 2:
                prefills_in.set()
            await prefills_in.wait()  # both prefills in flight before either answers
            return httpx.Response(200, json={**answer, "kv_transfer_params": KV})
        decoded_on.append(request.url.host)
        return httpx.Response(200, json=answer)

    app = router_app(handler, decode=[DECODE, second_decode])
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        for worker in app.state.router.registry.all():
            app.state.router.registry.record_health(worker, ok=True)
        body = {"model": "m", "prompt": "hello there", "max_tokens": 3}
        answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(2)))
    assert [r.status_code for r in answers] == [200, 200]
    assert sorted(decoded_on) == ["decode-b.test", "decode.test"]
    assert [w.inflight for w in app.state.router.registry.all()] == [0, 0, 0]
