"""The evaluation datasets by name: the vendored GSM8K splits, or synthetic problems in the same format.

Its own module so that :mod:`hybrid_pd.eval.data` (the problem format) and
:mod:`hybrid_pd.eval.synthetic` (which writes that format) do not import each other.
"""

from __future__ import annotations

from hybrid_pd.eval import synthetic
from hybrid_pd.eval.data import Problem, Split, load_gsm8k

__all__ = ["DATASETS", "load_problems"]

DATASETS = ("gsm8k", "synthetic")

# How many synthetic problems the test split has when no --limit is given (GSM8K has 1319).
SYNTHETIC_TEST_SIZE = 500
# The synthetic train split only feeds the k-shot prefix here; a few hundred is plenty.
SYNTHETIC_TRAIN_SIZE = 200


def load_problems(dataset: str, split: Split, limit: int | None = None, seed: int = 0) -> list[Problem]:
    """The first ``limit`` problems of ``dataset``'s ``split`` (all of them when ``limit`` is None)."""
    if dataset == "gsm8k":
        problems = load_gsm8k(split)
    elif dataset == "synthetic":
        size = SYNTHETIC_TEST_SIZE if split == "test" else SYNTHETIC_TRAIN_SIZE
        problems = synthetic.generate(limit if limit is not None else size, seed=seed, split=split)
    else:
        raise ValueError(f"unknown dataset {dataset!r} (choose from {', '.join(DATASETS)})")
    return problems if limit is None else problems[:limit]
