"""argparse types shared by the command-line tools."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["at_least"]


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse
