"""Bad input to any ``hybrid-pd`` subcommand is answered like the router answers a bad request.

Each case runs ``python -m hybrid_pd.cli ...`` as a user would, with one bad flag or
environment variable, and checks: exit code 2, no Python traceback, and a last line of
stderr that names the problem (the flag or variable, and what is wrong with it); any other
line is argparse's usage. Nothing starts: the worker cases use ``--dry-run`` or are refused
before vLLM starts, and ``up`` refuses before it starts a worker (its log folder stays
unmade). All cases run at once, a few processes at a time, in one fixture.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hybrid_pd.sizing.profile import Profile

ROOT = Path(__file__).resolve().parent.parent
# Far more than a refusal takes (about a second); a case that starts something runs into it.
TIMEOUT_S = 60
# A URL that is well formed: where a case is about another flag, nothing is sent to it.
URL = "http://127.0.0.1:9"
BENCH = ["bench", "--endpoint", URL, "--concurrency", "1", "--input-len", "8", "--output-len", "4", "--num-prompts", "1"]
PROFILE = ROOT / "hybrid_pd" / "bench" / "results" / "2026-11-25-h100x2-sizing" / "profile.json"
SIZE = {"--profile": str(PROFILE), "--gpus": "2", "--input-len": "1000", "--output-len": "64", "--concurrency": "4",
        "--slo-ttft-ms": "500", "--slo-tpot-ms": "20"}  # fmt: skip


def size(**changes: str | None) -> list[str]:
    """``hybrid-pd size`` with valid flags but ``changes`` (``input_len="9-5"``; None: left out)."""
    flags = {**SIZE, **{"--" + k.replace("_", "-"): v for k, v in changes.items()}}
    return ["size", *[a for flag, value in flags.items() if value is not None for a in (flag, value)]]


@dataclass(frozen=True)
class Case:
    argv: list[str]
    names: tuple[str, ...]  # what the problem line must contain
    env: dict[str, str] = field(default_factory=dict)
    hidden: tuple[str, ...] = ()  # what stderr must not show (secrets)


@dataclass(frozen=True)
class Paths:
    """Paths the cases point at: a file, a folder without a model, configs that are not plannable."""

    file: Path
    empty_dir: Path
    not_json: Path
    not_hybrid: Path
    logs: Path
    tp2_profile: Path


def cases(p: Paths, taken_port: int) -> dict[str, Case]:
    return {
        # the global flag
        "log-level": Case(["--log-level", "loud", "plan"], ("--log-level", "LOUD")),
        # plan
        "plan-tp-mismatch": Case(["plan", "--prefill-tp", "2", "--decode-tp", "3"], ("one must divide the other",)),
        "plan-no-model": Case(["plan", "--model", "/nonexistent"], ("/nonexistent", "model directory")),
        "plan-dir-without-config": Case(["plan", "--model", str(p.empty_dir)], (str(p.empty_dir / "config.json"),)),
        "plan-config-not-json": Case(["plan", "--model", str(p.not_json)], ("cannot read", str(p.not_json))),
        "plan-not-hybrid": Case(["plan", "--model", str(p.not_hybrid)], ("layer pattern", "llama")),
        "plan-tp-zero": Case(["plan", "--prefill-tp", "0"], ("--prefill-tp", ">= 1")),
        "plan-block-size-zero": Case(["plan", "--block-size", "0"], ("--block-size",)),
        "plan-bandwidth-zero": Case(["plan", "--bandwidth-gbps", "0"], ("--bandwidth-gbps", "more than 0")),
        "plan-not-a-number": Case(["plan", "--prompt-tokens", "many"], ("--prompt-tokens", "'many'")),
        "plan-speculation-not-json": Case(["plan", "--speculative-config", "{nope"], ("--speculative-config", "not JSON")),
        "plan-speculation-eagle": Case(["plan", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}',
                                        "--vllm-moves-draft-state", "no"], ("--speculative-config", "not method 'eagle'")),  # fmt: skip
        "plan-speculation-no-head": Case(["plan", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}',
                                          "--vllm-moves-draft-state", "no"], ("no MTP head",)),  # fmt: skip
        # workers
        "worker-tp-zero": Case(["decode", "--tensor-parallel-size", "0", "--dry-run"], ("--tensor-parallel-size 0",)),
        "worker-side-channel-port-zero": Case(
            ["prefill", "--side-channel-port", "0", "--dry-run"], ("--side-channel-port 0", "1 to 65535")
        ),
        "worker-port-too-big": Case(["decode", "--port", "70000", "--dry-run"], ("--port 70000", "1 to 65535")),
        "worker-max-model-len-zero": Case(["colocated", "--max-model-len", "0", "--dry-run"], ("--max-model-len 0",)),
        "worker-memory-fraction": Case(
            ["decode", "--gpu-memory-utilization", "1.5", "--dry-run"], ("--gpu-memory-utilization 1.5", "fraction")
        ),
        "worker-dtype": Case(["prefill", "--dtype", "fp7", "--dry-run"], ("--dtype fp7", "bfloat16")),
        "worker-kv-lease-zero": Case(["prefill", "--kv-lease-s", "0", "--dry-run"], ("--kv-lease-s 0",)),
        "worker-drain-negative": Case(["decode", "--drain-timeout-s", "-1", "--dry-run"], ("--drain-timeout-s -1",)),
        "worker-router-url": Case(["prefill", "--router-url", "router:8000", "--dry-run"], ("--router-url", "http://")),
        "worker-advertise-url": Case(["decode", "--advertise-url", "http://", "--dry-run"], ("--advertise-url",)),
        "worker-env-port": Case(["decode", "--dry-run"], ("HYBRID_PD_WORKER_PORT=abc", "integer"), {"HYBRID_PD_WORKER_PORT": "abc"}),
        "worker-env-list": Case(
            ["prefill", "--dry-run"], ("HYBRID_PD_WORKER_VLLM_ARGS", "JSON"), {"HYBRID_PD_WORKER_VLLM_ARGS": "--enforce-eager"}
        ),
        # not a dry run: refused before vLLM starts
        "worker-no-model": Case(["decode", "--model", "/nonexistent"], ("--model /nonexistent", "Hugging Face")),
        "worker-env-no-model": Case(
            ["prefill"], ("HYBRID_PD_WORKER_MODEL=./missing-model",), {"HYBRID_PD_WORKER_MODEL": "./missing-model"}
        ),
        # router
        "router-policy": Case(["router", "--decode-policy", "fastest", "--dry-run"], ("--decode-policy fastest", "round_robin")),
        "router-port": Case(["router", "--port", "99999", "--dry-run"], ("--port 99999", "1 to 65535")),
        "router-worker-url": Case(["router", "--decode", "decode:8200", "--dry-run"], ("--decode", "http://")),
        "router-timeout-zero": Case(["router", "--request-timeout-s", "0", "--dry-run"], ("--request-timeout-s 0",)),
        "router-concurrency-zero": Case(["router", "--max-concurrency", "0", "--dry-run"], ("--max-concurrency 0",)),
        "router-env-list": Case(
            ["router", "--dry-run"], ("HYBRID_PD_ROUTER_PREFILL", "JSON"), {"HYBRID_PD_ROUTER_PREFILL": "http://p:8100"}
        ),
        "router-env-secret": Case(
            ["router", "--dry-run"], ("HYBRID_PD_ROUTER_API_KEYS",), {"HYBRID_PD_ROUTER_API_KEYS": "sk-s3cret"}, ("s3cret",)
        ),
        # up: refused before a worker starts
        "up-no-model": Case(["up", "--model", "/nonexistent", "--log-dir", str(p.logs)], ("--model", "/nonexistent")),
        "up-port-zero": Case(["up", "--port", "0", "--log-dir", str(p.logs)], ("--port", "1 to 65535")),
        "up-port-taken": Case(["up", "--port", str(taken_port), "--log-dir", str(p.logs)], (f"127.0.0.1:{taken_port}", "in use")),
        "up-no-decode": Case(["up", "--decode", "0", "--log-dir", str(p.logs)], ("--decode 0 --flex 0", "at least 1")),
        "up-prefill-negative": Case(["up", "--prefill", "-1", "--log-dir", str(p.logs)], ("--prefill",)),
        "up-log-dir-is-a-file": Case(["up", "--log-dir", str(p.file)], ("--log-dir", "not a folder")),
        # eval
        "eval-no-endpoint": Case(["eval", "gsm8k"], ("--endpoint", "--export-jsonl")),
        "eval-endpoint-not-a-url": Case(["eval", "gsm8k", "--endpoint", "router:8000"], ("--endpoint", "http://host:port")),
        "eval-baseline-not-a-url": Case(["eval", "gsm8k", "--endpoint", URL, "--baseline", "colocated"], ("--baseline",)),
        "eval-timeout-zero": Case(["eval", "gsm8k", "--endpoint", URL, "--request-timeout-s", "0"], ("--request-timeout-s",)),
        "eval-json-unwritable": Case(
            ["eval", "gsm8k", "--endpoint", URL, "--json", str(p.file / "out.json")], ("--json", "not a folder")
        ),
        "eval-export-onto-a-file": Case(["eval", "gsm8k", "--export-jsonl", str(p.file)], ("--export-jsonl",)),
        "eval-tolerance": Case(["eval", "gsm8k", "--endpoint", URL, "--tolerance", "2"], ("--tolerance",)),
        # bench
        "bench-endpoint-not-a-url": Case(["bench", *BENCH[1:2], "router:8000", *BENCH[3:]], ("--endpoint", "http://")),
        "bench-timeout-negative": Case([*BENCH, "--request-timeout-s", "-1"], ("--request-timeout-s",)),
        "bench-json-is-a-folder": Case([*BENCH, "--json", str(p.empty_dir)], ("--json", "folder")),
        "bench-plot-unwritable": Case([*BENCH, "--plot", str(p.file / "x.png")], ("--plot",)),
        "bench-concurrency-zero": Case(["bench", "--endpoint", URL, "--concurrency", "0", *BENCH[5:]], ("--concurrency",)),
        # size: refused before anything is simulated
        "size-no-profile": Case(size(profile="/nonexistent.json"), ("--profile", "/nonexistent.json")),
        "size-profile-not-json": Case(size(profile=str(p.file)), ("--profile", "cannot read", str(p.file))),
        "size-gpus-zero": Case(size(gpus="0,2"), ("--gpus", "1 or more")),
        "size-input-len-range": Case(size(input_len="9-5"), ("--input-len", "LOW-HIGH")),
        "size-no-load": Case(size(concurrency=None), ("--concurrency", "--rate")),
        "size-turns-open-loop": Case(size(concurrency=None, rate="2", turns="3"), ("--turns", "--concurrency")),
        "size-turns-zero": Case(size(turns="0"), ("--turns", ">= 1")),
        "size-conversation-too-long": Case(size(turns="100", input_len="20000"), ("--turns", "KV cache")),
        "size-slo-zero": Case(size(slo_tpot_ms="0"), ("--slo-tpot-ms", "more than 0")),
        "size-request-too-long": Case(size(input_len="600000"), ("--input-len", "KV cache")),
        "size-json-is-a-folder": Case([*size(), "--json", str(p.empty_dir)], ("--json", "folder")),
        "size-two-profiles-of-one-size": Case([*size(), "--profile", str(PROFILE)], ("--profile", "two profiles of tensor_parallel_size 1")),
        "size-phases-form": Case([*size(input_len=None, output_len=None, concurrency=None), "--phases", "1000/512"], ("--phases", "IN/OUT@C[xN]")),
        "size-phases-and-lengths": Case([*size(), "--phases", "1000/512@8"], ("--phases", "leave out --input-len")),
        "size-phases-two-counts": Case([*size(input_len=None, output_len=None, concurrency=None, gpus="2,4"), "--phases", "1000/512@8"], ("--phases", "one --gpus count")),
        "size-phases-too-long": Case([*size(input_len=None, output_len=None, concurrency=None), "--phases", "600000/8@1"], ("--phases", "KV cache")),
        "size-gpus-without-a-layout": Case(size(profile=str(p.tp2_profile), gpus="2,3"), ("--gpus", "3 GPUs hold no layout", "[2]")),
    }


@dataclass(frozen=True)
class Result:
    returncode: int | None  # None: still running after TIMEOUT_S (then killed)
    stderr: str


def _run(case: Case) -> Result:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRID_PD_")} | case.env
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybrid_pd.cli", *case.argv],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # whatever it started goes with it on a timeout
    )
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
        return Result(proc.returncode, stderr)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # `up` stops the services it started, each in a group of its own
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
        return Result(None, stderr)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> Paths:
    root = tmp_path_factory.mktemp("usage")
    p = Paths(root / "a-file", root / "empty", root / "not-json", root / "llama", root / "logs", root / "tp2-profile.json")
    Profile.load(PROFILE).model_copy(update={"tensor_parallel_size": 2}).save(p.tp2_profile)
    p.file.write_text("x")
    p.empty_dir.mkdir()
    p.not_json.mkdir()
    (p.not_json / "config.json").write_text("{not json")
    p.not_hybrid.mkdir()
    (p.not_hybrid / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    return p


@pytest.fixture(scope="module")
def results(paths: Paths) -> dict[str, tuple[Case, Result]]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        table = cases(paths, taken.getsockname()[1])
        with ThreadPoolExecutor(max_workers=4) as pool:
            done = dict(zip(table, pool.map(_run, table.values())))
    return {name: (table[name], done[name]) for name in table}


CASE_NAMES = list(cases(Paths(*[Path("/")] * 6), 1))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_gets_one_line_and_exit_code_2(results: dict[str, tuple[Case, Result]], name: str):
    case, result = results[name]
    assert result.returncode is not None, f"still running after {TIMEOUT_S} s: it started something\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.rstrip("\n").splitlines()
    assert lines, "nothing on stderr"
    problem = lines[-1]
    for word in case.names:
        assert word in problem, f"{word!r} not in {problem!r}"
    before = lines[:-1]
    assert all(line.startswith(("usage:", " ")) for line in before), f"more than argparse's usage: {before}"
    for secret in case.hidden:
        assert secret not in result.stderr


def test_up_refuses_before_it_starts_anything(results: dict[str, tuple[Case, Result]], paths: Paths):
    up = [name for name in results if name.startswith("up-")]
    assert up and all(results[name][1].returncode == 2 for name in up)
    assert not paths.logs.exists(), "up made its log folder: it started workers"
