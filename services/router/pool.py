"""Which prefill and decode worker serve a request (static workers, round robin)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from services.common.openai_errors import OpenAIError

__all__ = ["Pair", "StaticPool"]


@dataclass(frozen=True)
class Pair:
    """The two workers of one disaggregated request."""

    prefill: str
    decode: str


class StaticPool:
    """A fixed list of prefill and decode workers, each taken in turn."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.prefill = list(prefill)
        self.decode = list(decode)
        self._prefill_turn = itertools.cycle(self.prefill)
        self._decode_turn = itertools.cycle(self.decode)

    def pick(self) -> Pair:
        """The next pair; 503 when a role has no worker."""
        if not self.prefill or not self.decode:
            raise OpenAIError(503, "no prefill or decode worker is configured")
        return Pair(prefill=next(self._prefill_turn), decode=next(self._decode_turn))
