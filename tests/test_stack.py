"""The local stack's plan (what `hybrid-pd up` starts) and its watchdog."""

import subprocess
import sys

from hybrid_pd.stack import Stack, StackConfig, watch


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


def test_cpu_workers_are_pinned_to_cores_in_turn():
    binds = [_flag(s.argv, "--cpu-threads-bind") for s in _stack(prefill=1, decode=1).workers("prefill") + _stack().workers("decode")]
    assert all(len(b) == 1 for b in binds)
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
