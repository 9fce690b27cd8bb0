"""Evaluation problems: the vendored GSM8K splits, or synthetic ones in the same format.

A problem is a question and a worked answer that ends in ``#### N``, exactly the
shape of a GSM8K JSONL row, so every dataset goes through the same prompt and scorer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

__all__ = ["DATASETS", "Problem", "Split", "load_gsm8k", "load_problems", "read_jsonl", "write_jsonl"]

Split = Literal["train", "test"]
DATASETS = ("gsm8k", "synthetic")

# How many synthetic problems the test split has when no --limit is given (GSM8K has 1319).
SYNTHETIC_TEST_SIZE = 500
# The synthetic train split only feeds the k-shot prefix here; a few hundred is plenty.
SYNTHETIC_TRAIN_SIZE = 200


@dataclass(frozen=True)
class Problem:
    """One word problem: ``answer`` is the worked solution, ending in ``#### N``."""

    question: str
    answer: str

    @property
    def target(self) -> str:
        """The final answer as written after ``#### `` (e.g. ``"1,234"``)."""
        return self.answer.rsplit("#### ", 1)[-1].strip()

    def to_json(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.answer}


def read_jsonl(path: Path | str) -> list[Problem]:
    """Problems from a GSM8K-format JSONL file (``question`` and ``answer`` per line)."""
    with open(path, encoding="utf-8") as f:
        return [_problem(json.loads(line)) for line in f if line.strip()]


def write_jsonl(problems: Iterable[Problem], path: Path | str) -> None:
    """Write problems as GSM8K-format JSONL."""
    with open(path, "w", encoding="utf-8") as f:
        for problem in problems:
            f.write(json.dumps(problem.to_json(), ensure_ascii=False) + "\n")


def load_gsm8k(split: Split) -> list[Problem]:
    """The vendored GSM8K split (train: 7473 problems, test: 1319), in file order."""
    source = resources.files("services.eval") / "data" / "gsm8k" / f"{split}.jsonl"
    with resources.as_file(source) as path:
        return read_jsonl(path)


def load_problems(dataset: str, split: Split, limit: int | None = None, seed: int = 0) -> list[Problem]:
    """The first ``limit`` problems of ``dataset``'s ``split`` (all of them when ``limit`` is None)."""
    if dataset == "gsm8k":
        problems = load_gsm8k(split)
    elif dataset == "synthetic":
        from services.eval import synthetic

        size = SYNTHETIC_TEST_SIZE if split == "test" else SYNTHETIC_TRAIN_SIZE
        problems = synthetic.generate(limit if limit is not None else size, seed=seed, split=split)
    else:
        raise ValueError(f"unknown dataset {dataset!r} (choose from {', '.join(DATASETS)})")
    return problems if limit is None else problems[:limit]


def _problem(row: dict[str, str]) -> Problem:
    if "#### " not in row["answer"]:
        raise ValueError(f"answer has no '#### ' final answer: {row['answer']!r}")
    return Problem(question=row["question"], answer=row["answer"])
