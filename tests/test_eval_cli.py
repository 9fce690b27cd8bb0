"""``hybrid-pd eval gsm8k`` end to end against scripted OpenAI-compatible servers in this process.

The servers answer completions deterministically from the question in the prompt, so this
tests the tool's I/O (requests, concurrency, scoring, reports, exit codes), not a model.
One uvicorn server serves several personalities under URL prefixes: ``/right``, ``/half``, ...
"""

from __future__ import annotations

import argparse
import json
import re
import socket
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hybrid_pd.bench.router.fake_upstream import serve_in_thread
from hybrid_pd.eval.cli import add_eval_parser, main, run_eval
from hybrid_pd.eval.data import read_jsonl
from hybrid_pd.eval.datasets import load_problems
from hybrid_pd.eval.prompts import STOP, build_prompt, fewshot_prefix

_LAST_QUESTION = re.compile(r"Question: ((?:(?!Question: ).)*)\nAnswer:$", re.S)


class FakeServers:
    """Scripted completion servers that know every question's answer and record what they were sent."""

    def __init__(self) -> None:
        problems = load_problems("synthetic", "test", limit=40) + load_problems("gsm8k", "test", limit=10)
        self.index = {p.question: (i, p.target) for i, p in enumerate(problems)}
        self.requests: list[tuple[str, dict]] = []
        self.in_flight = self.max_in_flight = 0
        self.app = FastAPI()

        @self.app.get("/{variant}/v1/models")
        async def models(variant: str) -> dict:
            return {"object": "list", "data": [{"id": f"fake-{variant}", "object": "model"}]}

        @self.app.post("/{variant}/v1/completions")
        async def completions(variant: str, request: Request) -> JSONResponse:
            body = await request.json()
            self.requests.append((variant, body))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await _yield_a_little()
                return self.answer(variant, body)
            finally:
                self.in_flight -= 1

    def answer(self, variant: str, body: dict) -> JSONResponse:
        question = _LAST_QUESTION.search(body["prompt"]).group(1)
        i, target = self.index[question]
        if variant == "flaky" and i % 5 == 0:
            return JSONResponse({"error": {"message": "engine died", "type": "InternalServerError"}}, status_code=500)
        if variant == "half" and i % 2:
            target = str(int(target.replace(",", "")) + 1)
        # Like a model that ignores nothing: it would go on to the next question, which the stop sequences cut.
        text = f" Thinking about it, the total is {target}.\n#### {target}\n\nQuestion: and then?"
        if variant == "flexible":
            text = f" So the answer is {target}."
        return JSONResponse(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": body["model"],
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 12, "total_tokens": 112},
            }
        )


async def _yield_a_little() -> None:
    import asyncio

    await asyncio.sleep(0.002)  # long enough for concurrent requests to overlap


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, FakeServers]]:
    fake = FakeServers()
    with serve_in_thread(fake.app) as url:
        yield url, fake


def parse(*argv: str) -> argparse.Namespace:
    """Parse as ``hybrid-pd eval ...`` would, through the wiring the main CLI uses."""
    parser = argparse.ArgumentParser(prog="hybrid-pd")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_parser(sub)
    return parser.parse_args(["eval", *argv])


def test_identical_endpoints_pass_and_requests_are_lm_eval_like(servers, tmp_path, capsys) -> None:
    url, fake = servers
    fake.requests.clear()
    out = tmp_path / "report.json"
    args = parse(
        "gsm8k",
        "--endpoint",
        f"{url}/right",
        "--baseline",
        f"{url}/right2/v1",
        "--dataset",
        "synthetic",
        "--limit",
        "40",
        "--concurrency",
        "8",
        "--json",
        str(out),
        "--min-agreement",
        "1",
    )
    assert run_eval(args) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.rstrip().endswith("PASS") and "identical generations  40/40 (100.0%)" in stdout
    assert "100.0%" in stdout and "\r" not in stderr  # no progress bar when stderr is not a terminal

    assert len(fake.requests) == 80 and 1 < fake.max_in_flight <= 8
    variant, body = fake.requests[0]
    assert body["model"] == f"fake-{variant}"  # resolved from each endpoint's /v1/models
    assert (
        body["temperature"] == 0.0
        and body["max_tokens"] == 256
        and body["stop"] == list(STOP)
        and body["stream"] is False
    )
    shots = load_problems("synthetic", "train", limit=5)
    expected = {build_prompt(fewshot_prefix(shots), p) for p in load_problems("synthetic", "test", limit=40)}
    assert {b["prompt"] for _, b in fake.requests} == expected

    report = json.loads(out.read_text())
    assert report["verdict"]["passed"] and report["comparison"]["agreement"] == 1.0
    assert report["endpoints"]["endpoint"]["strict_match"]["value"] == 1.0
    q = report["questions"][3]
    assert q["prompt"] in expected and q["identical"]
    assert q["endpoint"]["generation"].endswith(f"#### {q['target']}\n\n")  # cut at the "Question:" stop sequence
    assert q["endpoint"]["strict_correct"] and q["baseline"]["flexible_correct"]
    assert q["endpoint"]["completion_tokens"] == 12 and q["endpoint"]["finish_reason"] == "stop"


def test_accuracy_difference_fails_the_gate(servers, capsys) -> None:
    url, _ = servers
    args = parse(
        "gsm8k",
        "--endpoint",
        f"{url}/half",
        "--baseline",
        f"{url}/right",
        "--dataset",
        "synthetic",
        "--limit",
        "40",
        "--model",
        "m",
    )
    assert run_eval(args) == 1
    stdout = capsys.readouterr().out
    assert "-50.0 pts" in stdout and "FAIL: strict-match accuracy differs by -50.0 pts" in stdout
    # A generous tolerance passes the difference, but not a demand for identical generations.
    assert (
        run_eval(
            parse(
                "gsm8k",
                "--endpoint",
                f"{url}/half",
                "--baseline",
                f"{url}/right",
                "--dataset",
                "synthetic",
                "--limit",
                "40",
                "--tolerance",
                "0.5",
            )
        )
        == 0
    )
    assert (
        run_eval(
            parse(
                "gsm8k",
                "--endpoint",
                f"{url}/half",
                "--baseline",
                f"{url}/right",
                "--dataset",
                "synthetic",
                "--limit",
                "40",
                "--tolerance",
                "0.5",
                "--min-agreement",
                "0.9",
            )
        )
        == 1
    )
    assert "agreement 50.0% is below the minimum 90.0%" in capsys.readouterr().out


def test_flexible_only_answers(servers, capsys) -> None:
    url, _ = servers
    assert run_eval(parse("gsm8k", "--endpoint", f"{url}/flexible", "--dataset", "synthetic", "--limit", "10")) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"strict-match\s+0\.0%", stdout) and re.search(r"flexible-extract\s+100\.0%", stdout)


def test_request_errors_are_counted_and_fail(servers, tmp_path, capsys) -> None:
    url, _ = servers
    out = tmp_path / "errors.json"
    args = parse(
        "gsm8k",
        "--endpoint",
        f"{url}/flaky",
        "--baseline",
        f"{url}/right",
        "--dataset",
        "synthetic",
        "--limit",
        "40",
        "--tolerance",
        "1",
        "--json",
        str(out),
    )
    assert run_eval(args) == 3
    stdout = capsys.readouterr().out
    assert (
        "8 errors" in stdout and "error x8: HTTP 500:" in stdout and "8 of 40 requests to the endpoint failed" in stdout
    )
    report = json.loads(out.read_text())
    assert report["verdict"]["exit_code"] == 3 and report["endpoints"]["endpoint"]["errors"] == 8
    assert (
        report["questions"][0]["endpoint"]["generation"] is None
        and "engine died" in report["questions"][0]["endpoint"]["error"]
    )


def test_unreachable_endpoint(capsys) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert (
        run_eval(
            parse(
                "gsm8k",
                "--endpoint",
                f"http://127.0.0.1:{port}",
                "--dataset",
                "synthetic",
                "--limit",
                "3",
                "--model",
                "m",
            )
        )
        == 3
    )
    assert "3 errors" in capsys.readouterr().out
    assert (
        run_eval(parse("gsm8k", "--endpoint", f"http://127.0.0.1:{port}", "--dataset", "synthetic", "--limit", "3"))
        == 3
    )  # no /v1/models


def test_vendored_gsm8k_through_the_standalone_entry_point(servers, capsys) -> None:
    url, fake = servers
    fake.requests.clear()
    assert (
        main(
            [
                "--log-level",
                "WARNING",
                "gsm8k",
                "--endpoint",
                url + "/right",
                "--limit",
                "10",
                "--shots",
                "2",
                "--max-tokens",
                "64",
            ]
        )
        == 0
    )
    assert "gsm8k (gsm8k): 10 questions, 2-shot" in capsys.readouterr().out
    prompts = [b["prompt"] for _, b in fake.requests]
    assert len(prompts) == 10 and all(
        p.startswith("Question: Natalia sold clips") and p.count("Question: ") == 3 for p in prompts
    )
    assert all(b["max_tokens"] == 64 for _, b in fake.requests)


def test_argument_validation() -> None:
    for bad in (
        ["--tolerance", "-0.1"],
        ["--min-agreement", "1.5"],
        ["--limit", "0"],
        ["--concurrency", "0"],
        ["--dataset", "mmlu"],
    ):
        with pytest.raises(SystemExit):
            parse("gsm8k", "--endpoint", "http://x", *bad)
    assert run_eval(parse("gsm8k")) == 2  # --endpoint is required, unless --export-jsonl
    args = parse("gsm8k", "--endpoint", "http://x")
    assert (args.shots, args.max_tokens, args.tolerance, args.min_agreement, args.dataset, args.limit) == (
        5,
        256,
        0.05,
        0.0,
        "gsm8k",
        None,
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_export_jsonl_writes_the_problems_in_gsm8k_format_for_other_tools(tmp_path, capsys) -> None:
    out = tmp_path / "new" / "synthetic"  # made, with its parent
    assert main(["gsm8k", "--dataset", "synthetic", "--seed", "3", "--limit", "7", "--export-jsonl", str(out)]) == 0
    assert capsys.readouterr().out == "", "export only: no evaluation"
    test, train = _rows(out / "test.jsonl"), _rows(out / "train.jsonl")
    asked = load_problems("synthetic", "test", limit=7, seed=3)
    assert test == [p.to_json() for p in asked]
    assert train == [p.to_json() for p in load_problems("synthetic", "train", seed=3)]
    # GSM8K's own rows: the same two keys, a worked answer that ends in "#### N".
    with resources.as_file(resources.files("hybrid_pd.eval") / "data" / "gsm8k" / "test.jsonl") as vendored:
        gsm8k_keys = set(_rows(vendored)[0])
    assert all(set(row) == gsm8k_keys == {"question", "answer"} for row in test + train)
    assert all(re.search(r"\n#### [\d,]+$", row["answer"]) for row in test + train)
    assert not {r["question"] for r in test} & {r["question"] for r in train}
    # A tool that takes the first 5 train rows as shots builds the prompts this command sends.
    shots = load_problems("synthetic", "train", limit=5, seed=3)
    exported = read_jsonl(out / "test.jsonl")
    ours = [build_prompt(fewshot_prefix(shots), p) for p in asked]
    assert [build_prompt(fewshot_prefix(read_jsonl(out / "train.jsonl")[:5]), p) for p in exported] == ours


def test_export_jsonl_and_evaluate_in_one_run(servers, tmp_path) -> None:
    url, fake = servers
    fake.requests.clear()
    args = parse("gsm8k", "--endpoint", url + "/right", "--dataset", "synthetic", "--limit", "4", "--shots", "1",
                 "--export-jsonl", str(tmp_path))  # fmt: skip
    assert run_eval(args) == 0
    assert len(_rows(tmp_path / "test.jsonl")) == len(fake.requests) == 4


def test_help_says_how_to_export_the_problems() -> None:
    parser = argparse.ArgumentParser(prog="hybrid-pd")
    (gsm8k,) = add_eval_parser(parser.add_subparsers())._subparsers._group_actions[0].choices.values()
    text = " ".join(gsm8k.format_help().split())
    assert "--export-jsonl DIR" in text and "--dataset synthetic" in text
    assert "DIR/test.jsonl" in text and "DIR/train.jsonl" in text and "'#### N'" in text
