"""Synthetic GSM8K-format word problems: one- and two-step arithmetic, right by construction.

Each problem reads like a GSM8K one and is solved like one: a line of reasoning per
step with GSM8K's calculator annotations (``3 * 4 = <<3*4=12>>12``), then ``#### N``.
They serve two purposes: an evaluation set a tiny model can get right (``hybrid-pd eval
gsm8k --dataset synthetic``), and training data for such a model::

    from hybrid_pd.eval import synthetic
    train = synthetic.generate(10_000, seed=0, split="train")
    test = synthetic.generate(500, seed=0, split="test")

or ``python -m hybrid_pd.eval.synthetic --split train -n 10000 --out train.jsonl``.

Generation is deterministic in ``(n, seed, split)`` (Python's ``random.Random`` seeded
with a string, which does not depend on ``PYTHONHASHSEED``), and the first ``n`` problems
of a longer list are the same problems. The splits never share a question: a question
belongs to the test split when a hash of its text falls in a fixed 20% bucket, so the
split a problem is in does not depend on the seed or on how many were generated.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

from hybrid_pd.eval.data import Problem, Split, write_jsonl

__all__ = ["TEMPLATES", "Template", "generate", "split_of"]

_TEST_PERCENT = 20


@dataclass(frozen=True)
class _Person:
    name: str
    subject: str  # "she"
    possessive: str  # "her"


_PEOPLE = tuple(
    _Person(name, *pronouns)
    for names, pronouns in (
        (("Ava", "Maya", "Lena", "Nora", "Rosa", "Ines", "Priya", "Keiko", "Fatima", "Olga"), ("she", "her")),
        (("Ben", "Omar", "Luis", "Theo", "Ravi", "Kenji", "Tariq", "Jonas", "Diego", "Sam"), ("he", "his")),
    )
    for name in names
)
_FRIENDS = ("a neighbour", "a classmate", "a friend", "the teacher", "a cousin", "the school")
_ITEMS = (
    "apples",
    "marbles",
    "stickers",
    "pencils",
    "cookies",
    "books",
    "shells",
    "cards",
    "stamps",
    "oranges",
    "crayons",
    "beads",
)
_CONTAINERS = ("boxes", "bags", "packs", "jars", "baskets", "crates")
_GOODS = ("notebooks", "toy cars", "comic books", "sandwiches", "tickets", "plants", "T-shirts", "puzzles")


@dataclass(frozen=True)
class Template:
    """A kind of problem: ``make(rng)`` draws numbers and words and returns the problem."""

    name: str
    steps: int
    make: Callable[[random.Random], Problem]


def _solution(*lines: str, answer: int) -> str:
    return "\n".join(lines) + f"\n#### {answer}"


def _add(rng: random.Random) -> Problem:
    p, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    a, b = rng.randint(2, 90), rng.randint(2, 90)
    c = a + b
    return Problem(
        f"{p.name} has {a} {item}. {p.subject.capitalize()} buys {b} more {item}. "
        f"How many {item} does {p.name} have now?",
        _solution(f"{p.name} has {a} + {b} = <<{a}+{b}={c}>>{c} {item} now.", answer=c),
    )


def _subtract(rng: random.Random) -> Problem:
    p, item, friend = rng.choice(_PEOPLE), rng.choice(_ITEMS), rng.choice(_FRIENDS)
    b = rng.randint(2, 60)
    a = b + rng.randint(1, 80)
    c = a - b
    return Problem(
        f"{p.name} had {a} {item}. {p.subject.capitalize()} gave {b} of them to {friend}. "
        f"How many {item} does {p.name} have left?",
        _solution(f"{p.name} has {a} - {b} = <<{a}-{b}={c}>>{c} {item} left.", answer=c),
    )


def _multiply(rng: random.Random) -> Problem:
    p, item, box = rng.choice(_PEOPLE), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    a, b = rng.randint(2, 12), rng.randint(2, 25)
    c = a * b
    return Problem(
        f"{p.name} buys {a} {box} of {item}. Each of the {box} holds {b} {item}. How many {item} did {p.name} buy?",
        _solution(f"{p.name} bought {a} * {b} = <<{a}*{b}={c}>>{c} {item}.", answer=c),
    )


def _divide(rng: random.Random) -> Problem:
    p, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    b, c = rng.randint(2, 9), rng.randint(2, 15)
    a = b * c
    return Problem(
        f"{p.name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
        _solution(f"Each friend gets {a} / {b} = <<{a}/{b}={c}>>{c} {item}.", answer=c),
    )


def _add_groups(rng: random.Random) -> Problem:
    p, item, box = rng.choice(_PEOPLE), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    a, b, c = rng.randint(2, 50), rng.randint(2, 9), rng.randint(2, 12)
    d = b * c
    e = a + d
    return Problem(
        f"{p.name} has {a} {item}. {p.subject.capitalize()} buys {b} {box} with {c} {item} in each. "
        f"How many {item} does {p.name} have now?",
        _solution(
            f"The {box} hold {b} * {c} = <<{b}*{c}={d}>>{d} {item}.",
            f"{p.name} has {a} + {d} = <<{a}+{d}={e}>>{e} {item} now.",
            answer=e,
        ),
    )


def _spend(rng: random.Random) -> Problem:
    p, goods = rng.choice(_PEOPLE), rng.choice(_GOODS)
    b, c = rng.randint(2, 9), rng.randint(2, 15)
    d = b * c
    a = d + rng.randint(1, 60)
    e = a - d
    return Problem(
        f"{p.name} has ${a}. {p.subject.capitalize()} buys {b} {goods} that cost ${c} each. "
        f"How much money in dollars does {p.name} have left?",
        _solution(
            f"The {goods} cost {b} * {c} = $<<{b}*{c}={d}>>{d}.",
            f"{p.name} has {a} - {d} = $<<{a}-{d}={e}>>{e} left.",
            answer=e,
        ),
    )


def _earn(rng: random.Random) -> Problem:
    p = rng.choice(_PEOPLE)
    a, b, c = rng.randint(5, 25), rng.randint(2, 8), rng.randint(2, 7)
    d = a * b
    e = d * c
    return Problem(
        f"{p.name} earns ${a} an hour. {p.subject.capitalize()} works {b} hours a day for {c} days. "
        f"How much money in dollars does {p.name} earn?",
        _solution(
            f"{p.name} earns {a} * {b} = $<<{a}*{b}={d}>>{d} a day.",
            f"In {c} days {p.subject} earns {d} * {c} = $<<{d}*{c}={e}>>{e}.",
            answer=e,
        ),
    )


def _share_rest(rng: random.Random) -> Problem:
    p, item, box = rng.choice(_PEOPLE), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    c, e = rng.randint(2, 8), rng.randint(2, 12)
    d = c * e
    b = rng.randint(1, 30)
    a = d + b
    return Problem(
        f"{p.name} has {a} {item} and gives {b} of them away. "
        f"{p.subject.capitalize()} puts the rest equally into {c} {box}. "
        f"How many {item} are in each of the {box}?",
        _solution(
            f"{p.name} has {a} - {b} = <<{a}-{b}={d}>>{d} {item} left.",
            f"Each of the {box} gets {d} / {c} = <<{d}/{c}={e}>>{e} {item}.",
            answer=e,
        ),
    )


TEMPLATES: tuple[Template, ...] = (
    Template("add", 1, _add),
    Template("subtract", 1, _subtract),
    Template("multiply", 1, _multiply),
    Template("divide", 1, _divide),
    Template("add_groups", 2, _add_groups),
    Template("spend", 2, _spend),
    Template("earn", 2, _earn),
    Template("share_rest", 2, _share_rest),
)


def split_of(question: str) -> Split:
    """The split ``question`` belongs to: a fixed 20% hash bucket is the test split."""
    bucket = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % 100
    return "test" if bucket < _TEST_PERCENT else "train"


def generate(n: int, seed: int = 0, split: Split = "train") -> list[Problem]:
    """``n`` distinct problems of ``split``, deterministic in ``seed`` and ``split``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"hybrid-pd-synthetic:{seed}:{split}")
    problems: list[Problem] = []
    seen: set[str] = set()
    while len(problems) < n:
        problem = rng.choice(TEMPLATES).make(rng)
        if problem.question not in seen and split_of(problem.question) == split:
            seen.add(problem.question)
            problems.append(problem)
    return problems


def main(argv: list[str] | None = None) -> int:
    """Write synthetic problems as GSM8K-format JSONL (stdout by default)."""
    parser = argparse.ArgumentParser(prog="python -m hybrid_pd.eval.synthetic", description=main.__doc__)
    parser.add_argument("-n", type=int, default=1000, help="how many problems (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=["train", "test"], default="train")
    parser.add_argument("--out", default="/dev/stdout", help="JSONL file to write (default stdout)")
    args = parser.parse_args(argv)
    write_jsonl(generate(args.n, args.seed, args.split), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
