"""`hybrid-pd up` as a user runs it: ready line, answers, and SIGTERM leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from hybrid_pd.common.processes import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_up_serves_then_sigterm_stops_every_process_and_frees_every_port(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "hybrid_pd.cli", "up", "--port", str(port), "--log-dir", str(tmp_path)]
    if os.environ.get("HYBRID_PD_TEST_MODEL"):
        argv += ["--model", os.environ["HYBRID_PD_TEST_MODEL"]]
    up = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        printed = []
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, f"hybrid-pd up exited early:\n{''.join(printed)}"
            printed.append(line)
            if line.startswith("hybrid-pd ready:"):
                break
        assert f"http://127.0.0.1:{port}" in printed[-1]
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": model, "prompt": "Question: Maya has 41 beads. She buys 37 more beads. How many beads does Maya have now?\nAnswer:", "max_tokens": 64, "temperature": 0, "stop": ["Question:"]}, timeout=60)
        assert answer.status_code == 200
        if not os.environ.get("HYBRID_PD_TEST_MODEL"):  # the trained default answers the demo's question
            assert "#### 78" in answer.json()["choices"][0]["text"]
        chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True, "ignore_eos": True}
        streamed = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat, timeout=60)
        assert streamed.text.rstrip().endswith("data: [DONE]")

        family = psutil.Process(up.pid).children(recursive=True)
        assert len(family) >= 5, "router, two worker services and their vLLM servers"
        ports = {c.laddr.port for p in family for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        assert port in ports
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, f"orphans: {[(p.pid, p.name()) for p in alive]}"
        assert not any(_port_open(p) for p in ports), "a port is still open"
    finally:
        if up.poll() is None:
            up.kill()
