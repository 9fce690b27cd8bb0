"""vLLM's model-level paths through the router (hybrid_pd/router/aux_endpoints.py): which worker, what the client sees.

Scripted workers stand in for vLLM here; tests/e2e/test_lm_eval.py runs a real client
(lm-eval, default arguments) against real workers.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.router_support import PREFILL, asgi_client, probed, router_app

DECODE_A = "http://decode-a.test:2"
DECODE_B = "http://decode-b.test:3"


class _Vllm:
    """Workers answering like vLLM, serving the model ``models`` gives their host; records what clients asked (host, method, path, body)."""

    def __init__(self, models: dict[str, str]) -> None:
        self.models = models  # host -> served model
        self.calls: list[tuple[str, str, str, dict | None]] = []
        self.down: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host in self.down:
            raise httpx.ConnectError("connection refused")
        if path == "/health":
            return httpx.Response(200)
        model = self.models.get(host, "m")
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": model, "object": "model", "root": f"/{host}"}]})
        body = json.loads(request.content) if request.content else None
        if "x-request-id" in request.headers:  # forwarded for a client, not the router's own probe
            self.calls.append((host, request.method, path, body))
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/tokenizer_info":
            return httpx.Response(200, json={"eos_token": "<|eos|>", "tokenizer_class": "TokenizersBackend"})
        if path == "/tokenize":
            if not isinstance(body.get("prompt"), str):
                return httpx.Response(400, json={"error": {"message": "bad prompt", "type": "BadRequestError", "param": None, "code": 400}})
            return httpx.Response(200, json={"count": 2, "max_model_len": 4096, "tokens": [5, 6], "token_strs": None})
        if path == "/detokenize":
            return httpx.Response(200, json={"prompt": "hi"})
        return httpx.Response(404)


@pytest.fixture
def vllm() -> _Vllm:
    return _Vllm({"decode-a.test": "m", "decode-b.test": "m"})


@pytest.mark.parametrize(
    ("method", "path", "body", "answer"),
    [
        ("POST", "/tokenize", {"prompt": "hi", "add_special_tokens": False}, {"count": 2, "max_model_len": 4096, "tokens": [5, 6], "token_strs": None}),
        ("POST", "/detokenize", {"tokens": [5, 6]}, {"prompt": "hi"}),
        ("GET", "/tokenizer_info", None, {"eos_token": "<|eos|>", "tokenizer_class": "TokenizersBackend"}),
        ("GET", "/version", None, {"version": "0.32.0"}),
    ],
)
async def test_a_model_level_path_is_a_decode_workers_answer_as_it_came(vllm, method, path, body, answer):
    app = router_app(vllm)
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as c:
            r = await c.request(method, path, json=body, headers={"X-Request-Id": "req-7"})
    assert r.status_code == 200 and r.json() == answer and r.headers["x-request-id"] == "req-7"
    assert vllm.calls == [("decode.test", method, path, body)]
    assert app.state.router.metrics.requests.labels(path.strip("/"), "ok")._value.get() == 1


async def test_a_workers_own_error_goes_back_unchanged_and_is_counted_as_its_status(vllm):
    app = router_app(vllm)
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as c:
            r = await c.post("/tokenize", json={"prompt": 5})
    assert r.status_code == 400 and r.json()["error"] == {"message": "bad prompt", "type": "BadRequestError", "param": None, "code": 400}
    assert app.state.router.metrics.requests.labels("tokenize", "http_400")._value.get() == 1


async def test_the_generation_paths_auth_body_limit_and_errors_hold(vllm):
    app = router_app(vllm, api_keys=["sk-1"], max_body_bytes=64)
    key = {"Authorization": "Bearer sk-1"}
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as c:
            no_key = await c.post("/tokenize", json={"prompt": "hi"})
            no_key_get = await c.get("/v1/models")
            too_big = await c.post("/tokenize", json={"prompt": "x" * 100}, headers=key)
            not_json = await c.post("/detokenize", content=b"{nope", headers=key)
            wrong_method = await c.get("/tokenize", headers=key)
            ok = await c.get("/version", headers=key)
    assert no_key.status_code == no_key_get.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    assert too_big.status_code == 413 and "larger than 64 bytes" in too_big.json()["error"]["message"]
    assert not_json.status_code == 400 and not_json.json()["error"]["message"].startswith("request body is not valid JSON")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert ok.status_code == 200
    assert [path for _, _, path, _ in vllm.calls] == ["/version"]
    rejected = app.state.router.metrics.rejected
    assert [rejected.labels(s)._value.get() for s in ("401", "413", "400")] == [2, 1, 1]


async def test_the_worker_is_one_serving_the_model_named(vllm):
    vllm.models = {"decode-a.test": "alpha", "decode-b.test": "beta"}
    app = router_app(vllm, decode=[DECODE_A, DECODE_B])
    async with app.router.lifespan_context(app):
        await probed(app)
        async with asgi_client(app) as c:
            for model in ("beta", "alpha", "beta"):
                assert (await c.post("/tokenize", json={"model": model, "prompt": "hi"})).status_code == 200
            unknown = await c.post("/tokenize", json={"model": "gamma", "prompt": "hi"})
            unnamed = await c.post("/tokenize", json={"prompt": "hi"})
            info = await c.get("/tokenizer_info")
    assert [host for host, *_ in vllm.calls] == ["decode-b.test", "decode-a.test", "decode-b.test"]
    # vLLM's own answer to a model it does not serve, and a 400 in its shape where the model is ambiguous
    assert unknown.status_code == 404 and unknown.json()["error"] == {
        "message": "The model `gamma` does not exist. Valid aliases: alpha, beta.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert unnamed.status_code == info.status_code == 400
    assert unnamed.json()["error"]["param"] == "model" and unnamed.json()["error"]["type"] == "BadRequestError"


async def test_with_one_model_a_request_naming_none_goes_to_a_worker_of_it(vllm):
    app = router_app(vllm, decode=[DECODE_A, DECODE_B])
    async with app.router.lifespan_context(app):
        await probed(app)
        app.state.router.registry.by_url(DECODE_A).inflight = 3  # busy with generation
        async with asgi_client(app) as c:
            r = await c.post("/detokenize", json={"tokens": [1]})
    assert r.status_code == 200 and [host for host, *_ in vllm.calls] == ["decode-b.test"]  # the least busy


async def test_models_lists_every_model_once_each_from_one_of_its_workers(vllm):
    vllm.models = {"decode-a.test": "alpha", "decode-b.test": "beta", "decode-c.test": "alpha"}
    app = router_app(vllm, decode=[DECODE_A, DECODE_B, "http://decode-c.test:4"])
    async with app.router.lifespan_context(app):
        await probed(app)
        async with asgi_client(app) as c:
            r = await c.get("/v1/models")
    assert r.status_code == 200 and r.json()["object"] == "list"
    assert [(m["id"], m["root"]) for m in r.json()["data"]] == [("alpha", "/decode-a.test"), ("beta", "/decode-b.test")]


async def test_one_model_is_its_workers_list_byte_for_byte(vllm):
    app = router_app(vllm, decode=[DECODE_A, DECODE_B])
    async with app.router.lifespan_context(app):
        await probed(app)
        async with asgi_client(app) as c:
            r = await c.get("/v1/models")
    assert r.json() == {"object": "list", "data": [{"id": "m", "object": "model", "root": "/decode-a.test"}]}


async def test_flexible_workers_alone_answer_as_decode_workers_do(vllm):
    """`hybrid-pd up --flex 2 --prefill 0 --decode 0` (the planner's default): no worker registered as decode, yet every
    flexible worker decodes. Before, /v1/models answered 503 there and `vllm bench serve` could not start."""
    app = router_app(vllm, prefill=[], decode=[], flex=[DECODE_A, DECODE_B])
    async with app.router.lifespan_context(app):
        await probed(app)
        async with asgi_client(app) as c:
            models = await c.get("/v1/models")
            version = await c.get("/version")
    assert models.json() == {"object": "list", "data": [{"id": "m", "object": "model", "root": "/decode-a.test"}]}
    assert version.status_code == 200 and version.json() == {"version": "0.32.0"}


async def test_no_healthy_decode_worker_is_503_and_an_unreachable_one_502(vllm):
    vllm.down.add("decode.test")
    app = router_app(vllm)
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as c:
            none = await c.post("/tokenize", json={"prompt": "hi"})
            models = await c.get("/v1/models")
        decode = app.state.router.registry.by_url("http://decode.test:2")
        decode.healthy, decode.failures = True, 0  # it answered a check, then went down
        async with asgi_client(app) as c:
            gone = await c.get("/version")
    assert none.status_code == models.status_code == 503 and none.headers["retry-after"] == "1"
    assert none.json()["error"]["message"] == "no decode worker is available"
    assert gone.status_code == 502 and gone.json()["error"]["message"] == "decode worker unreachable: ConnectError"


async def test_a_prefill_worker_is_never_asked(vllm):
    app = router_app(vllm, prefill=[PREFILL])
    async with app.router.lifespan_context(app):
        async with asgi_client(app) as c:
            for _ in range(3):
                await c.post("/tokenize", json={"prompt": "hi"})
    assert {host for host, *_ in vllm.calls} == {"decode.test"}
