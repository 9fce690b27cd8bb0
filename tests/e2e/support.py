"""Plain helpers the end-to-end tests share: reading vLLM's metrics and the NIXL trace, waiting.

The fixtures live in ``tests/e2e/conftest.py``; test modules import these from here,
never from a conftest or from each other.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from hybrid_pd.common.prom import metric_sum


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
