"""A one-line progress bar on stderr, drawn only when stderr is a terminal.

No dependency: a carriage return and a rewritten line, at most ten times a second.
In CI logs (not a TTY) it prints nothing; the final report says everything.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 30


class Progress:
    """Counts finished requests for one endpoint and redraws the bar as they finish."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.done = self.errors = 0
        self._started = time.monotonic()
        self._drawn = 0.0
        self._drawn_done = -1

    def advance(self, error: bool = False) -> None:
        """One more request finished (``error``: it failed)."""
        self.done += 1
        self.errors += int(error)
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= 0.1 or self.done == self.total):
            self._drawn = now
            self._draw(now)

    def close(self) -> None:
        """End the bar's line so what follows starts on a fresh one."""
        if self.enabled:
            if self._drawn_done != self.done:
                self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        self._drawn_done = self.done
        filled = _WIDTH * self.done // self.total if self.total else _WIDTH
        rate = self.done / max(now - self._started, 1e-9)
        errors = f" errors {self.errors}" if self.errors else ""
        bar = "#" * filled + "." * (_WIDTH - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {rate:.1f}/s{errors}")
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
