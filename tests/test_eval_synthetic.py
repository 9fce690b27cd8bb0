"""The synthetic GSM8K-format generator: deterministic, disjoint splits, right by construction."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from hybrid_pd.eval import synthetic
from hybrid_pd.eval.data import read_jsonl
from hybrid_pd.eval.datasets import load_problems
from hybrid_pd.eval.scoring import score

_CALC = re.compile(r"<<([0-9+\-*/ ]+)=(-?\d+)>>(-?\d+)")


def test_deterministic_and_prefix_stable() -> None:
    assert synthetic.generate(50, seed=3) == synthetic.generate(50, seed=3)
    assert synthetic.generate(20, seed=3) == synthetic.generate(50, seed=3)[:20]
    assert synthetic.generate(50, seed=3) != synthetic.generate(50, seed=4)
    assert synthetic.generate(0) == []


def test_splits_are_disjoint_and_questions_distinct() -> None:
    train = synthetic.generate(2000, seed=0, split="train")
    test = synthetic.generate(500, seed=0, split="test")
    train_questions = {p.question for p in train}
    assert len(train_questions) == 2000 and len({p.question for p in test}) == 500
    assert not train_questions & {p.question for p in test}
    assert all(synthetic.split_of(p.question) == "test" for p in test)
    assert all(synthetic.split_of(p.question) == "train" for p in synthetic.generate(200, seed=9, split="train"))


def test_answers_are_right_by_construction() -> None:
    problems = synthetic.generate(1000, seed=1) + synthetic.generate(300, seed=1, split="test")
    for p in problems:
        *steps, last = p.answer.split("\n")
        assert re.fullmatch(r"#### \d+", last), p.answer
        calcs = _CALC.findall(p.answer)
        assert len(calcs) == len(steps) >= 1
        for expression, result, shown in calcs:
            assert eval(expression) == int(result) == int(shown), p.answer  # the expression is digits and + - * / only
            for number in re.findall(r"\d+", expression):  # every operand is in the question or an earlier step
                assert number in re.findall(r"\d+", p.question) or any(number == r for _, r, _ in calcs), p
        assert p.target == calcs[-1][1]
        assert score(p.answer, p.answer).strict_correct  # the gold answer passes the scorer


def test_templates_cover_one_and_two_steps() -> None:
    problems = synthetic.generate(400, seed=0)
    steps = Counter(p.answer.count("<<") for p in problems)
    assert set(steps) == {1, 2} and min(steps.values()) > 50
    assert {t.steps for t in synthetic.TEMPLATES} == {1, 2}


def test_one_step_addition_from_its_question() -> None:
    adds = [p for p in synthetic.generate(300, seed=2) if "more" in p.question]
    assert adds
    for p in adds:
        a, b = map(int, re.findall(r"\d+", p.question))
        assert int(p.target) == a + b


def test_dataset_loader_and_jsonl_cli(tmp_path) -> None:
    assert load_problems("synthetic", "test", limit=7, seed=5) == synthetic.generate(7, seed=5, split="test")
    assert len(load_problems("synthetic", "test")) == 500
    out = tmp_path / "train.jsonl"
    assert synthetic.main(["-n", "12", "--seed", "1", "--out", str(out)]) == 0
    assert read_jsonl(out) == synthetic.generate(12, seed=1)
    with pytest.raises(ValueError):
        load_problems("nope", "test")
