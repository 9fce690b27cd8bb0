"""Scoring a generation the way lm-eval's ``gsm8k`` task does (``exact_match``, two filters).

- ``strict-match``: the first match of ``#### (\\-?[0-9\\.\\,]+)``, i.e. the model must
  write GSM8K's own final-answer marker.
- ``flexible-extract``: the last match of ``(-?[$0-9.,]{2,})|(-?[0-9]+)`` anywhere in the
  generation (the non-empty group of that match), i.e. "the last number".

No match gives lm-eval's fallback ``"[invalid]"``, which is never correct. The extracted
answer and the reference (the full worked answer) then go through lm-eval's
``exact_match`` normalisation: remove each of the regexes ``,``, ``\\$``, ``(?s).*#### ``
and ``\\.$`` in that order, lower-case, and compare the strings (``ignore_punctuation``
is off). So ``"$1,234."`` equals a reference ending in ``#### 1234``, but ``"18.00"``
does not equal ``"18"``: lm-eval compares strings, not numbers, and so does this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["INVALID", "Score", "extract_flexible", "extract_strict", "is_match", "normalize", "score"]

INVALID = "[invalid]"  # lm-eval RegexFilter's fallback when nothing matches

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = (re.compile(r","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


@dataclass(frozen=True)
class Score:
    """What both filters extracted from one generation, and whether each is right."""

    strict: str
    flexible: str
    strict_correct: bool
    flexible_correct: bool


def _extract(pattern: re.Pattern[str], text: str, group_select: int) -> str:
    """lm-eval's ``regex`` filter followed by ``take_first``."""
    matches = pattern.findall(text)
    if not matches:
        return INVALID
    match: str | tuple[str, ...] = matches[group_select]
    if isinstance(match, tuple):  # several groups: the first one that matched
        match = next(m for m in match if m)
    return match.strip()


def extract_strict(text: str) -> str:
    """The ``strict-match`` answer: what follows the first ``#### `` (or ``[invalid]``)."""
    return _extract(_STRICT, text, 0)


def extract_flexible(text: str) -> str:
    """The ``flexible-extract`` answer: the last number-like run (or ``[invalid]``)."""
    return _extract(_FLEXIBLE, text, -1)


def normalize(text: str) -> str:
    """lm-eval ``exact_match`` normalisation with the gsm8k task's settings."""
    for pattern in _IGNORE:
        text = pattern.sub("", text)
    return text.lower()


def is_match(extracted: str, reference: str) -> bool:
    """Whether an extracted answer equals the reference answer after normalisation."""
    return normalize(extracted) == normalize(reference)


def score(generation: str, reference: str) -> Score:
    """Score one generation against the reference worked answer (``... #### N``)."""
    strict, flexible = extract_strict(generation), extract_flexible(generation)
    return Score(strict, flexible, is_match(strict, reference), is_match(flexible, reference))
