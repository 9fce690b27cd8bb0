"""The local stack's plan (what `hybrid-pd up` starts) and its watchdog."""

import subprocess
import sys
import time

from hybrid_pd.common.processes import free_port, spawn
from hybrid_pd.stack import Service, Stack, StackConfig, watch


def _stack(**kw) -> Stack:
    return Stack(StackConfig(model="/models/m", served_model_name="m", **kw))


def _flag(argv, name):
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


def test_plan_starts_each_role_with_distinct_ports_and_the_router_knows_them():
    stack = _stack(prefill=2, decode=3, baseline=True)
    names = [s.name for s in stack.services]
    assert names == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "colocated-0", "router"]
    workers = [s for s in stack.services if s.name != "router"]
    ports = [p for s in workers for p in _flag(s.argv, "--port") + _flag(s.argv, "--side-channel-port")]
    assert len(ports) == len(set(ports)) == 2 * 5 + 1, "colocated has no side channel"
    router = stack.services[-1].argv
    assert _flag(router, "--prefill") == [s.url for s in stack.workers("prefill")]
    assert _flag(router, "--decode") == [s.url for s in stack.workers("decode")]
    assert all(s.argv[3] == s.name.split("-")[0] for s in workers), "each runs `hybrid-pd <role>`"


def test_flexible_workers_go_behind_the_router_with_its_extra_flags_and_record_no_timeline():
    stack = _stack(prefill=0, decode=0, flex=2, baseline=True, timeline_dir="/tmp/tl", router_args=("--slo-ttft-ms=500",))
    assert [s.name for s in stack.services] == ["flex-0", "flex-1", "colocated-0", "router"]
    router = stack.services[-1].argv
    assert _flag(router, "--flex") == [s.url for s in stack.workers("flex")] and router[-1] == "--slo-ttft-ms=500"
    assert all(len(_flag(s.argv, "--side-channel-port")) == 1 and _flag(s.argv, "--timeline-dir") == [] for s in stack.workers("flex"))


def _binds(stack: Stack) -> dict[str, int]:
    return {s.name: int(core) for s in stack.services for core in _flag(s.argv, "--cpu-threads-bind")}


def test_cpu_decode_workers_never_share_a_core_with_a_prefill_worker_where_there_is_one_to_spare(monkeypatch):
    """The e2e session's stack on the 2-core VM: its second decode worker had shared core 0 with the prefill worker, and
    that pair's first pull stalled (docs/reliability.md); the first decode worker, on core 1, never did."""
    monkeypatch.setattr("hybrid_pd.stack._cores", lambda: 2)
    assert _binds(_stack(prefill=1, decode=2, baseline=True)) == {"prefill-0": 0, "decode-0": 1, "decode-1": 1, "colocated-0": 1}
    assert _binds(_stack(prefill=1, decode=1, baseline=True)) == {"prefill-0": 0, "decode-0": 1, "colocated-0": 1}
    monkeypatch.setattr("hybrid_pd.stack._cores", lambda: 4)
    assert _binds(_stack(prefill=2, decode=3)) == {"prefill-0": 0, "prefill-1": 1, "decode-0": 2, "decode-1": 3, "decode-2": 2}
    assert _binds(_stack(prefill=0, decode=0, flex=3, baseline=True)) == {"flex-0": 0, "flex-1": 1, "flex-2": 2, "colocated-0": 3}
    monkeypatch.setattr("hybrid_pd.stack._cores", lambda: 1)  # no core to spare: all on the one
    assert set(_binds(_stack(prefill=1, decode=2)).values()) == {0}
    assert _flag(_stack(device="cuda").services[0].argv, "--cpu-threads-bind") == []


def test_a_timeline_folder_goes_to_the_router_and_the_pd_workers_not_the_baseline():
    stack = _stack(baseline=True, timeline_dir="/tmp/tl")
    traced = {s.name for s in stack.services if _flag(s.argv, "--timeline-dir") == ["/tmp/tl"]}
    assert traced == {"prefill-0", "decode-0", "router"}
    assert all(_flag(s.argv, "--timeline-dir") == [] for s in _stack(baseline=True).services)


def _sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_watch_keeps_serving_when_one_decode_dies_and_stops_when_none_is_left():
    stack = _stack(prefill=1, decode=2)
    procs = {"prefill-0": _sleeper(0), "decode-0": _sleeper(0.2), "decode-1": _sleeper(0.6), "router": _sleeper(30)}
    stack._procs = procs
    try:
        assert watch(stack, poll_s=0.05) == "no decode worker is left"
        assert procs["decode-1"].poll() is not None, "it waited for the last decode worker"
        assert procs["router"].poll() is None
    finally:
        procs["router"].kill()


def test_watch_stops_when_the_router_exits():
    stack = _stack()
    stack._procs = {"prefill-0": _sleeper(30), "decode-0": _sleeper(30), "router": _sleeper(0)}
    try:
        assert watch(stack, poll_s=0.05) == "the router exited"
    finally:
        for p in stack._procs.values():
            p.kill()


# A service that answers as a worker (/health, /v1/models) or, given worker URLs, as the router (/health with
# them available). Each run is counted in RUNS; with FAIL_FIRST, its first run fails as a worker whose vLLM died
# does (exit 3); with EXIT, every run exits with that code at once.
STAND_IN = r"""
import http.server, json, os, sys
port, model, runs, fail_first, exit_code, workers = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:]
with open(runs, "a") as f:
    f.write("run\n")
if exit_code:
    sys.exit(int(exit_code))
if fail_first and not os.path.exists(fail_first):
    open(fail_first, "w").close()
    sys.exit(3)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if workers:
            body = {"prefill": workers[:1], "decode": workers[1:], "available": {"prefill": workers[:1], "decode": workers[1:]}}
        else:
            body = {"data": [{"root": model}]}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _stand_in_stack(tmp_path, fail_first: frozenset[str] = frozenset(), exit_codes: dict[str, int] | None = None, **kw) -> Stack:
    """The plan of a 1 prefill + 1 decode stack, each service replaced by STAND_IN on its planned port."""
    stack = Stack(StackConfig(model="/models/m", served_model_name="m", port=free_port(), log_dir=tmp_path / "logs",
                              ready_timeout_s=30, restart_backoff_s=0.05, **kw))  # fmt: skip
    workers = [s.url for s in stack.workers("prefill") + stack.workers("decode")]
    services = []
    for s in stack.services:
        argv = [sys.executable, "-c", STAND_IN, s.url.rsplit(":", 1)[1], "/models/m", str(tmp_path / f"{s.name}.runs"),
                str(tmp_path / f"{s.name}.failed") if s.name in fail_first else "", str((exit_codes or {}).get(s.name, "")),
                *(workers if s.name == "router" else [])]  # fmt: skip
        services.append(Service(s.name, argv, s.url, s.health))
    stack.services = services
    return stack


def _runs(tmp_path, name: str) -> int:
    path = tmp_path / f"{name}.runs"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_start_restarts_a_worker_that_fails_while_the_stack_starts(tmp_path, caplog):
    """Issue #27: a worker whose vLLM died during start-up left `hybrid-pd up` waiting, never ready."""
    stack = _stand_in_stack(tmp_path, fail_first=frozenset({"prefill-0"}))
    caplog.set_level("INFO")
    try:
        stack.start()
        assert stack.failed() == []
    finally:
        stack.stop()
    assert [_runs(tmp_path, name) for name in ("prefill-0", "decode-0", "router")] == [2, 1, 1]
    assert "prefill-0 exited code=3: see" in caplog.text and "attempt=1/3" in caplog.text


def test_watch_restarts_a_failed_worker_with_growing_pauses_then_gives_up(tmp_path, caplog):
    stack = _stand_in_stack(tmp_path, exit_codes={"decode-0": 3}, restarts=2)
    stack._procs = {s.name: spawn(s.argv) for s in stack.services}
    started = time.monotonic()
    try:
        assert watch(stack, poll_s=0.05) == "no decode worker is left"
    finally:
        stack.stop()
    assert _runs(tmp_path, "decode-0") == 3, "the first run and two tries"
    assert time.monotonic() - started >= 0.05 + 0.1, "paused 0.05 s, then 0.1 s"
    attempts = [r.getMessage() for r in caplog.records if "attempt=" in r.getMessage()]
    assert [a.rsplit("attempt=", 1)[-1] for a in attempts] == ["1/2", "2/2"], attempts
    assert "decode-0 failed 3 times in a row; not starting it again code=3" in caplog.text
    assert _runs(tmp_path, "prefill-0") == 1


def test_a_worker_back_in_service_gets_its_tries_back(tmp_path, caplog):
    stack = _stand_in_stack(tmp_path, fail_first=frozenset({"decode-0"}))
    caplog.set_level("INFO")
    stack._procs = {"decode-0": spawn(stack._service("decode-0").argv)}
    try:
        stack._procs["decode-0"].wait(30)
        assert stack.revive("decode-0")
        deadline = time.monotonic() + 30
        while not stack.recovered():
            assert time.monotonic() < deadline, "the restarted worker never answered"
            time.sleep(0.1)
        assert stack._tries["decode-0"] == 0
        assert "decode-0 is ready again restarts=1" in caplog.text
    finally:
        stack.stop()


def test_workers_stopped_on_purpose_or_refusing_their_settings_are_not_started_again(tmp_path):
    stack = _stand_in_stack(tmp_path, exit_codes={"prefill-0": 0, "decode-0": 2, "router": 3})
    stack._procs = {s.name: spawn(s.argv) for s in stack.services}
    try:
        for proc in stack._procs.values():
            proc.wait(30)
        assert not stack.revive("decode-0"), "exit 2: settings refused before vLLM started"
        assert not stack.revive("prefill-0"), "exit 0: stopped on purpose"
        assert not stack.revive("router"), "the router is not restarted"
    finally:
        stack.stop()
    assert [_runs(tmp_path, name) for name in ("prefill-0", "decode-0", "router")] == [1, 1, 1]


def test_up_waits_longer_than_a_worker_waits_for_its_own_vllm():
    """A worker ends a start that overruns its phase budgets or --ready-timeout-s itself and exits 3, and `up` starts it
    again (as Compose's start_period and the Kubernetes startup probe allow more than --ready-timeout-s): `up` must not
    give up on a worker before the worker gives up on its vLLM."""
    from hybrid_pd.worker.settings import WorkerSettings

    assert _stack().config.ready_timeout_s >= WorkerSettings().ready_timeout_s + 30


def test_up_with_flexible_workers_gives_the_router_the_embedded_models_profile_unless_told_otherwise(caplog):
    """`hybrid-pd up --flex N` runs the planner by default: on CPU with the embedded model, its shipped profile; a profile the
    user names wins; another model (no profile shipped) runs whole requests and says why; one flexible worker has no layout."""
    from hybrid_pd.cli import _planner_profile, build_parser
    from hybrid_pd.router.settings import RouterSettings

    def flags(*argv: str) -> tuple[str, ...]:
        return _planner_profile(build_parser().parse_args(["up", *argv]))

    (default,) = flags("--flex", "2")
    assert default == "--planner-profile=tiny-cpu" and RouterSettings(planner_profile=default.split("=")[1]).planner_profile
    assert flags("--flex", "2", "--router-arg=--planner-profile=/p.json") == ()
    assert flags("--flex", "1") == () and flags("--prefill", "1", "--decode", "1") == ()
    assert flags("--flex", "4", "--model", "ibm-granite/granite-4.0-h-tiny") == ()
    assert "4 flexible workers serve whole requests: no profile of ibm-granite/granite-4.0-h-tiny on cpu" in caplog.text
