"""The k-shot prompt of lm-eval's ``gsm8k`` task, and where generation stops.

lm-eval renders a problem as ``doc_to_text`` = ``"Question: {question}\\nAnswer:"``; a
solved example adds the target delimiter ``" "`` and the full worked answer; examples
and the question are joined by the few-shot delimiter ``"\\n\\n"``. So a 2-shot prompt is::

    Question: <q1>
    Answer: <a1>

    Question: <q2>
    Answer: <a2>

    Question: <q>
    Answer:

The shots are the first K problems of the train split, the same for every question
(lm-eval draws K random train problems per question with a fixed seed instead; fixed
shots keep the prompt a pure function of the question, identical for both endpoints).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid_pd.eval.data import Problem

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_SHOTS",
    "STOP",
    "build_prompt",
    "fewshot_prefix",
    "question_text",
    "truncate_at_stop",
]

DEFAULT_SHOTS = 5
DEFAULT_MAX_TOKENS = 256  # lm-eval's max_gen_toks
STOP: tuple[str, ...] = ("Question:", "</s>", "<|im_end|>")  # lm-eval gsm8k's generation_kwargs.until

_TARGET_DELIMITER = " "
_FEWSHOT_DELIMITER = "\n\n"


def question_text(question: str) -> str:
    """lm-eval's ``doc_to_text``: the question as the model sees it, ready for the answer."""
    return f"Question: {question}\nAnswer:"


def fewshot_prefix(shots: Sequence[Problem]) -> str:
    """The solved examples that precede every question ("" for zero shots)."""
    return "".join(question_text(s.question) + _TARGET_DELIMITER + s.answer + _FEWSHOT_DELIMITER for s in shots)


def build_prompt(prefix: str, problem: Problem) -> str:
    """The full prompt: the few-shot prefix, then the question."""
    return prefix + question_text(problem.question)


def truncate_at_stop(text: str, stop: Sequence[str] = STOP) -> str:
    """Cut ``text`` at the first stop sequence, as a server honouring ``stop`` would have."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]
