"""lm-eval, a client built for vLLM servers, with its default arguments: through the router it answers as colocated.

``local-completions`` with default arguments tokenizes on the server: it reads ``/tokenizer_info``,
then ``/tokenize`` and ``/detokenize``, and sends token-id prompts to ``/v1/completions``.
``local-chat-completions`` sends chat messages (lm-eval asks for ``--apply_chat_template`` with
it). Each runs a small GSM8K task (tests/e2e/lm_eval_tasks, synthetic problems the embedded model
solves, exported by ``hybrid-pd eval gsm8k --export-jsonl``) against the router and against the
colocated server; every question's generation must be the same, and so the scores. Offline:
the data are local files, the hub is never asked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybrid_pd.cli import main as hybrid_pd

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TASKS = Path(__file__).parent / "lm_eval_tasks"
TASK = "hybrid_pd_gsm8k_synthetic"
PROBLEMS = 8
TARGET = 0.75  # the embedded model's strict-match floor on these problems (it scores ~0.95 on 200)

Run = tuple[dict, dict[int, dict]]  # lm-eval's scores for the task, its samples by doc id


@pytest.fixture(scope="module")
def evaluate(tmp_path_factory) -> Iterator[Callable[..., Run]]:
    """lm-eval's ``simple_evaluate`` of the task: ``evaluate(model, base_url, served_model, **options)``.

    Model arguments are lm-eval's defaults besides ``model`` and ``base_url``. It runs in this
    process, offline, in the directory of the problems (``hybrid-pd eval gsm8k --export-jsonl``)
    where the task's ``data_files`` are; its task index holds only our task (lm-eval's CLI indexes
    its ~10,000 built-in tasks first: 14 s a run on 2 cores).
    """
    problems = tmp_path_factory.mktemp("lm-eval-problems")
    assert hybrid_pd(["eval", "gsm8k", "--dataset", "synthetic", "--limit", str(PROBLEMS), "--export-jsonl", str(problems)]) == 0
    with pytest.MonkeyPatch.context() as env:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.setenv(name, "1")
        env.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))
        env.chdir(problems)
        import lm_eval  # here: the hub and datasets libraries read the environment above when imported
        from lm_eval.tasks import TaskManager

        tasks = TaskManager(include_path=str(TASKS), include_defaults=False)

        def run(model: str, base_url: str, served: str, **options: object) -> Run:
            out = lm_eval.simple_evaluate(
                model=model, model_args={"model": served, "base_url": base_url}, tasks=[TASK], task_manager=tasks, log_samples=True, **options
            )
            return out["results"][TASK], {sample["doc_id"]: sample for sample in out["samples"][TASK]}

        yield run


def _count(url: str, route: str) -> float:
    """The router's count of requests on ``route`` that ended ok."""
    samples = (s for f in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in f.samples)
    return next(s.value for s in samples if s.name == "hybrid_pd_requests_total" and s.labels == {"route": route, "outcome": "ok"})


def _same_answers(router: Run, colocated: Run) -> None:
    (router_scores, router_samples), (colocated_scores, colocated_samples) = router, colocated
    assert sorted(router_samples) == sorted(colocated_samples) == list(range(PROBLEMS))
    for doc, sample in router_samples.items():
        assert sample["resps"] == colocated_samples[doc]["resps"], f"question {doc}: P/D and colocated generated differently"
    for metric in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert router_scores[metric] == colocated_scores[metric], metric


def test_local_completions_with_default_arguments_scores_as_colocated(stack, evaluate):
    asked = {route: _count(stack.url, route) for route in ("tokenizer_info", "tokenize", "completions")}
    served = stack.config.served_model_name
    router = evaluate("local-completions", f"{stack.url}/v1/completions", served)
    colocated = evaluate("local-completions", f"{stack.workers('colocated')[0].url}/v1/completions", served)
    _same_answers(router, colocated)
    print(f"\nlm-eval local-completions: router {router[0]} colocated {colocated[0]}")
    assert router[0]["exact_match,strict-match"] >= TARGET
    # lm-eval tokenized on the server through the router (its default), and generated through it
    for route in ("tokenizer_info", "tokenize"):
        assert _count(stack.url, route) > asked[route], f"lm-eval never asked the router's /{route}"
    assert _count(stack.url, "completions") - asked["completions"] == PROBLEMS


def test_local_chat_completions_with_default_arguments_answers_as_colocated(stack, evaluate):
    asked = _count(stack.url, "chat")
    served = stack.config.served_model_name
    router = evaluate("local-chat-completions", f"{stack.url}/v1/chat/completions", served, apply_chat_template=True)
    colocated = evaluate("local-chat-completions", f"{stack.workers('colocated')[0].url}/v1/chat/completions", served, apply_chat_template=True)
    _same_answers(router, colocated)
    print(f"\nlm-eval local-chat-completions: router {router[0]} colocated {colocated[0]}")
    assert _count(stack.url, "chat") - asked == PROBLEMS
