"""``docker compose --profile cpu up`` for real: images from the repository's Dockerfiles, Compose v2 on Podman.

What the static tests (tests/test_deploy.py) cannot see: that the services find each other by
name, that health gates the router, that the state crosses NIXL between two containers
(decode joins prefill's IPC and PID namespaces, the side channel and UCX go over the compose
network), that the router's published port answers what a colocated server answers, and
that ``down -v`` leaves nothing behind.
"""

from __future__ import annotations

import json

import httpx

from hybrid_pd.common.prom import metric_sum
from tests.compose.sandbox_support import MODEL, Compose, container, in_container, nixl_reads

# A problem the embedded model solves (README's example): greedy, so every server must say the same.
COMPLETION = {
    "model": MODEL,
    "prompt": "Question: Maya has 41 beads. She buys 37 more beads. How many beads does Maya have now?\nAnswer:",
    "max_tokens": 48,
    "temperature": 0,
    "stop": ["Question:"],
}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tom has 12 apples. He eats 5 apples. How many apples does Tom have now?"}], "max_tokens": 32, "temperature": 0}


def why_not_pulled(stack: Compose, router: httpx.Client) -> str:
    """What a missing pull leaves behind: the router's reasons for local prefills, vLLM's NIXL failures, the decode worker's log."""
    decode = in_container(stack, "decode-cpu", "/metrics")
    routed = router.get("/metrics").text
    counters = {
        name: metric_sum(text, name)
        for text, names in (
            (routed, ("hybrid_pd_fallbacks_total", "hybrid_pd_disaggregated_total")),
            (decode, ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total")),
        )
        for name in names
    }
    fallbacks = [line for line in routed.splitlines() if line.startswith("hybrid_pd_fallbacks_total{")]
    log = stack("logs", "--tail=60", "decode-cpu")
    return f"{counters}\n{fallbacks}\ndecode-cpu's last lines:\n{log}"


def streamed_chat(router: httpx.Client, body: dict) -> str:
    text = []
    with router.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return "".join(text)


def test_services_are_wired_like_the_gpu_profile(stack: Compose):
    """Three healthy containers; decode has its own network namespace but prefill's PID (and init) and IPC."""
    names = {s: container(stack, s) for s in ("prefill-cpu", "decode-cpu", "router-cpu")}
    for name in names.values():
        assert stack.engine.podman("inspect", "--format", "{{.State.Health.Status}}", name).strip() == "healthy"
    addresses = {
        s: stack.engine.podman("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", n).strip()
        for s, n in names.items()
    }
    assert len(set(addresses.values())) == 3 and all(addresses.values()), addresses
    # PID 1 of decode's PID namespace is prefill's init, whose child is the prefill worker.
    pid1 = stack.engine.podman("exec", names["decode-cpu"], "cat", "/proc/1/cmdline").split("\0")
    assert "prefill" in pid1 and pid1[0].endswith("init"), pid1
    ipc = {s: stack.engine.podman("exec", names[s], "readlink", "/proc/self/ns/ipc").strip() for s in ("prefill-cpu", "decode-cpu")}
    assert ipc["prefill-cpu"] == ipc["decode-cpu"]
    net = {s: stack.engine.podman("exec", names[s], "readlink", "/proc/self/ns/net").strip() for s in ("prefill-cpu", "decode-cpu")}
    assert net["prefill-cpu"] != net["decode-cpu"]


def test_completion_and_chat_cross_nixl_and_equal_colocated(stack: Compose, router: httpx.Client):
    """Through the router's published port: the decode worker pulled the state, no fallback, colocated's tokens."""
    reads_before = nixl_reads(stack)

    completion = router.post("/v1/completions", json=COMPLETION)
    assert completion.status_code == 200, completion.text
    chat = streamed_chat(router, CHAT)

    assert nixl_reads(stack) >= reads_before + 2, f"the decode worker did not read the state over NIXL: {why_not_pulled(stack, router)}"
    router_metrics = router.get("/metrics").text
    assert metric_sum(router_metrics, "hybrid_pd_fallbacks_total") == 0
    assert metric_sum(router_metrics, "hybrid_pd_requests_total") >= 2

    # Colocated: the decode worker asked directly, without kv_transfer_params, prefills locally.
    colocated = json.loads(in_container(stack, "decode-cpu", "/v1/completions", COMPLETION))
    colocated_chat = json.loads(in_container(stack, "decode-cpu", "/v1/chat/completions", CHAT))
    text = completion.json()["choices"][0]["text"]
    assert text == colocated["choices"][0]["text"]
    assert "#### 78" in text, text
    assert chat == colocated_chat["choices"][0]["message"]["content"] and chat


def test_down_removes_every_container_network_and_volume(stack: Compose):
    stack("down", "--volumes", "--timeout=30")
    assert stack.engine.podman("ps", "--all", "--quiet").split() == []
    assert stack.engine.podman("volume", "ls", "--quiet").split() == []
    # The engine is this run's own: the only network left is Podman's default.
    assert stack.engine.podman("network", "ls", "--format", "{{.Name}}").split() == ["podman"]
