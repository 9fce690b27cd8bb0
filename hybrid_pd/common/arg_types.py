"""argparse types shared by the command-line tools."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["at_least", "checked"]

T = TypeVar("T")


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse


def checked(convert: Callable[[str], T], check: Callable[[T], Any]) -> Callable[[str], T]:
    """An argparse type: ``convert`` the text, then ``check`` it (:mod:`hybrid_pd.common.checks`).

    The check's ``ValueError`` becomes argparse's error, so the flag's problem is printed
    on one line and the command exits 2, naming the flag.
    """

    def parse(text: str) -> T:
        value = convert(text)  # a ValueError here: argparse says "invalid <convert> value: 'text'"
        try:
            return check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse
