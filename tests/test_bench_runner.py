"""``hybrid-pd bench`` against a fake OpenAI SSE server in this process: requests, counts, report fields.

The fake (``hybrid_pd.bench.router.fake_upstream``) streams ``max_tokens`` token events and a usage event,
and fails on purpose for prompts that start with one of its ``FAIL_*`` ids. Timings are not
asserted, only counts and fields.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from hybrid_pd.bench.cli import add_bench_parser, run_bench
from hybrid_pd.bench.client import ClientPool, Sampling, complete
from hybrid_pd.bench.router.fake_upstream import FAIL_EVENT, FAIL_HTTP, FAIL_MIDSTREAM, NO_USAGE, FakeOpenAI, serve_in_thread
from hybrid_pd.bench.runner import Load, Target, run_level


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, FakeOpenAI]]:
    app = FakeOpenAI(model="fake-model")
    with serve_in_thread(app) as url:
        yield url, app


def parse(*argv: str) -> argparse.Namespace:
    """Parse as ``hybrid-pd bench ...`` would, through the wiring the main CLI uses."""
    parser = argparse.ArgumentParser(prog="hybrid-pd")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    return parser.parse_args(["bench", *argv])


def _run_level(url: str, prompts: list[list[int]], load: Load, stream: bool = True):
    async def go():
        async with ClientPool(timeout=30) as pool:
            target = Target("endpoint", url, "fake-model")
            return await run_level(pool, target, prompts, Sampling("fake-model", 5, stream=stream), load, seed=1)

    return asyncio.run(go())


def test_streamed_requests_are_timed_and_counted_from_usage(fake) -> None:
    url, _ = fake
    run = _run_level(url, [[1, 2, 3]] * 6, Load("concurrency", 3))
    assert len(run.results) == 6 and run.duration_s > 0
    for r in run.results:
        assert r.ok and r.status == 200 and r.usage_reported
        assert r.output_tokens == 5 and r.prompt_tokens == 3
        assert r.ttft_s is not None and 0 <= r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == 4 and r.tpot_s is not None


def test_json_answers_and_poisson_arrivals(fake) -> None:
    url, _ = fake
    run = _run_level(url, [[7, 8]] * 5, Load("rate", 200.0), stream=False)
    assert [r.output_tokens for r in run.results] == [5] * 5
    assert all(r.ok and r.ttft_s is None and r.itl_s == () for r in run.results)


def test_every_kind_of_failure_is_an_error_not_a_crash(fake) -> None:
    url, _ = fake
    prompts = [[FAIL_HTTP, 1], [FAIL_MIDSTREAM, 1], [FAIL_EVENT, 1], [NO_USAGE, 1], [1, 1]]
    run = _run_level(url, prompts, Load("concurrency", 2))
    http, midstream, event, no_usage, fine = run.results
    assert http.error.startswith("HTTP 500") and http.status == 500
    assert midstream.error and not midstream.ok  # the connection dropped mid-stream
    assert event.error == "error event: injected error event"
    assert no_usage.ok and not no_usage.usage_reported and no_usage.output_tokens == 5  # counted from events
    assert fine.ok and fine.usage_reported


def test_unreachable_server_is_an_error() -> None:
    async def go():
        async with httpx.AsyncClient(timeout=5) as client:
            return await complete(client, "http://127.0.0.1:9/v1/completions", Sampling("m", 2).body([1]))

    result = asyncio.run(go())
    assert not result.ok and result.error.startswith("ConnectError")


def test_request_body_asks_for_exact_lengths() -> None:
    body = Sampling("m", 8).body([4, 5])
    assert body == {
        "model": "m",
        "prompt": [4, 5],
        "max_tokens": 8,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert "stream_options" not in Sampling("m", 8, stream=False).body([4])


def test_cli_runs_endpoint_and_baseline_per_level_and_writes_json(fake, tmp_path, capsys) -> None:
    url, app = fake
    app.counts.clear()
    out = tmp_path / "bench.json"
    args = parse(
        "--endpoint", f"{url}/v1", "--baseline", url,
        "--concurrency", "1,4", "--input-len", "16", "--output-len", "7", "--num-prompts", "6",
        "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000", "--json", str(out), "--seed", "3", "--warmup", "2",
    )  # fmt: skip
    assert run_bench(args) == 0
    stdout, stderr = capsys.readouterr()
    assert "\r" not in stderr  # no progress bar when stderr is not a terminal
    rows = [line.split() for line in stdout.splitlines() if line.startswith(("c=1 ", "c=4 "))]
    assert [r[:4] for r in rows] == [
        ["c=1", "endpoint", "6", "0"],
        ["c=1", "baseline", "6", "0"],
        ["c=4", "endpoint", "6", "0"],
        ["c=4", "baseline", "6", "0"],
    ]
    assert app.counts["decode_stream"] == 2 * (2 + 2 * 6)  # warm-up + two levels, for each target

    report = json.loads(out.read_text())
    assert report["config"]["input_len"] == 16 and report["config"]["vocab_size"] == 256  # no readable model dir
    assert report["targets"]["endpoint"]["model"] == "fake-model"  # from /v1/models
    assert report["errors"] == 0
    for level in report["levels"]:
        for role in ("endpoint", "baseline"):
            s = level[role]
            assert s["completed"] == 6 and s["errors"] == 0 and s["output_tokens"] == 42 and s["input_tokens"] == 96
            assert s["slo_met"] == 6 and s["goodput"] > 0 and s["length_mismatches"] == 0
            assert s["ttft_ms"]["count"] == 6 and s["itl_ms"]["count"] == 36 and s["e2e_ms"]["p99"] > 0
            assert len(s["per_request"]) == 6


def test_cli_counts_errors_and_exits_3(tmp_path, capsys) -> None:
    args = parse(
        "--endpoint", "http://127.0.0.1:9", "--model", "m", "--vocab-size", "10",
        "--rate", "inf", "--input-len", "4", "--output-len", "2", "--num-prompts", "3", "--warmup", "0",
        "--json", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert run_bench(args) == 3
    assert "error x3: ConnectError" in capsys.readouterr().out
    level = json.loads((tmp_path / "r.json").read_text())["levels"][0]
    assert level["load"] == {"kind": "rate", "value": "inf"} and level["endpoint"]["errors"] == 3


def test_cli_without_models_endpoint_exits_3(fake) -> None:
    url, _ = fake
    args = parse("--endpoint", url + "/nowhere", "--concurrency", "1", "--input-len", "4", "--output-len", "2", "--num-prompts", "1")
    assert run_bench(args) == 3


def test_plot_needs_matplotlib_or_says_how_to_get_it(fake, tmp_path, caplog) -> None:
    url, _ = fake
    args = parse(
        "--endpoint", url, "--concurrency", "1,2", "--input-len", "4", "--output-len", "3", "--num-prompts", "2",
        "--plot", str(tmp_path / "p.png"),
    )  # fmt: skip
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert run_bench(args) == 2
        assert "hybrid-pd[bench]" in caplog.text
    else:
        assert run_bench(args) == 0
        assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_bad_arguments_are_usage_errors() -> None:
    for argv in (
        ["--endpoint", "u", "--input-len", "4", "--output-len", "2", "--num-prompts", "1"],  # no load
        ["--endpoint", "u", "--concurrency", "1", "--rate", "2", "--input-len", "4", "--output-len", "2", "--num-prompts", "1"],
        ["--endpoint", "u", "--concurrency", "0", "--input-len", "4", "--output-len", "2", "--num-prompts", "1"],
        ["--endpoint", "u", "--concurrency", "1", "--input-len", "0", "--output-len", "2", "--num-prompts", "1"],
    ):
        with pytest.raises(SystemExit) as exc:
            parse(*argv)
        assert exc.value.code == 2
