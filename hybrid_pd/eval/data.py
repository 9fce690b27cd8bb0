"""Evaluation problems in GSM8K's format: the problem type, JSONL files and the vendored GSM8K splits.

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

__all__ = ["Problem", "Split", "load_gsm8k", "read_jsonl", "write_jsonl"]

Split = Literal["train", "test"]


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
    source = resources.files("hybrid_pd.eval") / "data" / "gsm8k" / f"{split}.jsonl"
    with resources.as_file(source) as path:
        return read_jsonl(path)


def _problem(row: dict[str, str]) -> Problem:
    if "#### " not in row["answer"]:
        raise ValueError(f"answer has no '#### ' final answer: {row['answer']!r}")
    return Problem(question=row["question"], answer=row["answer"])
