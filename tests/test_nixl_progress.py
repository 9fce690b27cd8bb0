"""NIXL's progress thread sleeps between polls once throttled (hybrid_pd/connector/vllm/nixl_progress.py).

Each case runs a real NIXL agent, created the way vLLM creates it, in a fresh
process and reads that process's CPU time while the agent sits idle.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

IDLE_S = 2.0

_AGENT = """
import os, sys, time
os.environ.update(UCX_TLS="tcp,self,sm", UCX_NET_DEVICES="lo")
from hybrid_pd.connector.vllm.nixl_progress import throttle_progress_thread
if sys.argv[1] != "0":
    config_cls = throttle_progress_thread(int(sys.argv[1]))
    probe = config_cls()
    probe.pthrDelay = 0  # what nixl_agent writes
    assert probe.pthrDelay == int(sys.argv[1]), probe.pthrDelay
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
agent = NixlWrapper("probe", nixl_agent_config(num_threads=4, capture_telemetry=True))  # vLLM's call
time.sleep(0.5)
before = time.process_time()
time.sleep(float(sys.argv[2]))
print(time.process_time() - before)
"""


def _idle_cpu_seconds(delay_us: int) -> float:
    out = subprocess.run([sys.executable, "-c", _AGENT, str(delay_us), str(IDLE_S)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


def test_an_unthrottled_agent_spins_and_a_throttled_one_sleeps():
    spinning = _idle_cpu_seconds(0)
    throttled = _idle_cpu_seconds(1000)
    assert spinning > 0.25 * IDLE_S, f"NIXL no longer spins when idle ({spinning:.2f} CPU-s): is the throttle still needed?"
    assert throttled < 0.1 * IDLE_S, f"the throttled agent used {throttled:.2f} CPU-s in {IDLE_S} s idle"


def test_throttle_refuses_a_delay_that_would_spin():
    from hybrid_pd.connector.vllm.nixl_progress import throttle_progress_thread

    with pytest.raises(ValueError):
        throttle_progress_thread(0)
