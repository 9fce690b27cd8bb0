"""Scoring and prompts behave like lm-eval's ``gsm8k`` task (strict-match, flexible-extract, 5-shot format)."""

from __future__ import annotations

import pytest

from hybrid_pd.eval.data import Problem, load_gsm8k
from hybrid_pd.eval.datasets import load_problems
from hybrid_pd.eval.prompts import STOP, build_prompt, fewshot_prefix, question_text, truncate_at_stop
from hybrid_pd.eval.scoring import INVALID, extract_flexible, extract_strict, is_match, normalize, score

REFERENCE = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
)


@pytest.mark.parametrize(
    ("generation", "strict"),
    [
        ("The answer is #### 1,234.", "1,234."),  # the class includes ',' and '.', so the trailing dot is captured
        ("#### -7", "-7"),
        ("#### 5\n#### 6", "5"),  # the first match
        ("so 12.\n#### 12\n\n", "12"),
        ("####18", INVALID),  # lm-eval's pattern wants the space
        ("The answer is 18.", INVALID),
        ("", INVALID),
    ],
)
def test_strict_extraction(generation: str, strict: str) -> None:
    assert extract_strict(generation) == strict


@pytest.mark.parametrize(
    ("generation", "flexible"),
    [
        ("She has 3 apples and 5 pears, so 8 in all", "8"),  # the last number
        ("It costs $18", "$18"),
        ("Total: 1,234.", "1,234."),
        ("He walks 7 miles", "7"),  # a single digit comes from the second group
        ("It drops to -3 degrees", "-3"),
        ("18 apples then 2 more days", "2"),
        ("#### 42\n\nThen 7", "7"),  # not the #### one: flexible is "the last number"
        ("no numbers here", INVALID),
    ],
)
def test_flexible_extraction(generation: str, flexible: str) -> None:
    assert extract_flexible(generation) == flexible


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("$18", "18"),
        ("1,234.", "1234"),
        ("18.00", "18.00"),  # string comparison, as lm-eval: 18.00 != 18
        ("3.5", "3.5"),
        (REFERENCE, "18"),  # the reference keeps only what follows '#### '
        ("The Answer", "the answer"),
        (INVALID, INVALID),
    ],
)
def test_normalize(text: str, normalized: str) -> None:
    assert normalize(text) == normalized


def test_score_against_reference() -> None:
    good = score(" She makes 9 * 2 = $18 every day.\n#### 18", REFERENCE)
    assert (good.strict, good.flexible, good.strict_correct, good.flexible_correct) == ("18", "18", True, True)
    flexible_only = score(" She makes $18.", REFERENCE)
    assert (
        flexible_only.strict,
        flexible_only.strict_correct,
        flexible_only.flexible,
        flexible_only.flexible_correct,
    ) == (INVALID, False, "$18.", True)
    wrong = score(" #### 17", REFERENCE)
    assert not wrong.strict_correct and not wrong.flexible_correct
    assert is_match("1,234.", "blah\n#### 1234")
    assert not is_match("18.00", REFERENCE)
    assert not is_match(INVALID, "#### 0")


def test_prompt_format() -> None:
    shots = [Problem("What is 1+1?", "1+1=<<1+1=2>>2\n#### 2"), Problem("What is 2*3?", "2*3=<<2*3=6>>6\n#### 6")]
    prefix = fewshot_prefix(shots)
    assert (
        prefix == "Question: What is 1+1?\nAnswer: 1+1=<<1+1=2>>2\n#### 2\n\n"
        "Question: What is 2*3?\nAnswer: 2*3=<<2*3=6>>6\n#### 6\n\n"
    )
    assert build_prompt(prefix, Problem("What is 4-1?", "#### 3")) == prefix + "Question: What is 4-1?\nAnswer:"
    assert build_prompt(fewshot_prefix([]), Problem("Q?", "#### 1")) == question_text("Q?") == "Question: Q?\nAnswer:"


def test_gsm8k_is_vendored_and_fewshot_uses_the_first_train_problems() -> None:
    train, test = load_gsm8k("train"), load_gsm8k("test")
    assert (len(train), len(test)) == (7473, 1319)
    assert test[0].target == "18" and test[0].question.startswith("Janet")
    shots = load_problems("gsm8k", "train", limit=5)
    assert shots == train[:5]
    prompt = build_prompt(fewshot_prefix(shots), test[0])
    assert prompt.startswith("Question: Natalia sold clips")
    assert prompt.count("Question: ") == 6 and prompt.count("\n#### ") == 5
    assert prompt.endswith("\nAnswer:") and "\n\n\n" not in prompt


def test_stop_sequences_and_truncation() -> None:
    assert STOP == ("Question:", "</s>", "<|im_end|>")
    assert truncate_at_stop(" 9 * 2 = 18\n#### 18\n\nQuestion: next") == " 9 * 2 = 18\n#### 18\n\n"
    assert truncate_at_stop("a</s>b<|im_end|>") == "a"
    assert truncate_at_stop("no stop here") == "no stop here"
