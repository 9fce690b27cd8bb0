"""The traffic a layout is sized for, as the seeded requests the simulation sends.

Lengths are fixed or uniform over a range (``1000`` or ``800-1200``), as ``vllm bench serve``'s
random dataset draws them. The load is either closed-loop, ``concurrency`` requests kept in
flight from time 0 (``vllm bench serve --max-concurrency``: a request is sent when one
finishes), or open-loop, Poisson arrivals at ``rate`` requests/s. The same seed gives the same
requests and arrival times, so every layout is simulated against the same traffic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["Lengths", "Request", "Workload", "default_prompts"]

# Requests to simulate when not told: past the start's transient, at a bounded cost.
MIN_PROMPTS, WAVES, SECONDS = 200, 5, 60


def default_prompts(concurrency: int | None, rate: float | None) -> int:
    """Five closed-loop waves (``concurrency`` each), or a minute of arrivals at ``rate``; at least 200."""
    return max(MIN_PROMPTS, WAVES * concurrency if concurrency is not None else math.ceil(SECONDS * (rate or 0)))


@dataclass(frozen=True)
class Lengths:
    """Token counts drawn uniformly from ``low..high`` (fixed when equal)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``N`` or ``LOW-HIGH``, each at least 1."""
        low, _, high = text.partition("-")
        lengths = cls(int(low), int(high or low))
        if lengths.low < 1 or lengths.high < lengths.low:
            raise ValueError(f"{text!r}: give N or LOW-HIGH with 1 <= LOW <= HIGH")
        return lengths

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True)
class Request:
    """One request: its prompt and output tokens, and when it is sent (None: when the closed loop has room)."""

    id: int
    prompt: int
    output: int
    sent_s: float | None


@dataclass(frozen=True)
class Workload:
    input_len: Lengths
    output_len: Lengths
    num_prompts: int
    concurrency: int | None = None  # closed loop: requests kept in flight
    rate: float | None = None  # open loop: Poisson arrivals per second
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give a concurrency or a rate, not both")

    def requests(self) -> list[Request]:
        """The requests in the order they are sent; open-loop ones with their arrival times."""
        rng = random.Random(self.seed)
        out, t = [], 0.0
        for i in range(self.num_prompts):
            sent = None
            if self.rate is not None:
                sent = t
                t += rng.expovariate(self.rate)
            out.append(Request(i, self.input_len.draw(rng), self.output_len.draw(rng), sent))
        return out

    @property
    def load(self) -> str:
        return f"{self.concurrency} in flight" if self.concurrency is not None else f"{self.rate:g} req/s"
