"""The traffic a layout is sized for, as the seeded requests the simulation sends.

Lengths are fixed or uniform over a range (``1000`` or ``800-1200``), as ``vllm bench serve``'s
random dataset draws them. The load is either closed-loop, ``concurrency`` requests kept in
flight from time 0 (``vllm bench serve --max-concurrency``: a request is sent when one
finishes), or open-loop, Poisson arrivals at ``rate`` requests/s. The same seed gives the same
requests and arrival times, so every layout is simulated against the same traffic.

Multi-turn chat (``turns`` > 1, closed loop), as ``hybrid_pd.bench.multiturn`` sends it:
``concurrency`` conversations at once, each a system prompt of its own (``system_len`` tokens)
and ``turns`` requests, each turn sent when the last one's answer is done; a turn's prompt is the
conversation so far (every earlier prompt and answer) plus a user message of ``input_len`` tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["SLO", "Lengths", "Request", "Workload", "default_prompts", "parse_phase"]

# Requests to simulate when not told: past the start's transient, at a bounded cost.
MIN_PROMPTS, WAVES, SECONDS = 200, 5, 60


def default_prompts(concurrency: int | None, rate: float | None) -> int:
    """Five closed-loop waves (``concurrency`` each), or a minute of arrivals at ``rate``; at least 200."""
    return max(MIN_PROMPTS, WAVES * concurrency if concurrency is not None else math.ceil(SECONDS * (rate or 0)))


@dataclass(frozen=True)
class SLO:
    """The targets a request is judged by: its time to first token and its time per output token, in ms."""

    ttft_ms: float
    tpot_ms: float

    def __str__(self) -> str:
        return f"{self.ttft_ms:g}/{self.tpot_ms:g}"

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``TTFT/TPOT`` in ms, each above 0 (``500/20``)."""
        ttft, _, tpot = text.partition("/")
        try:
            slo = cls(float(ttft), float(tpot))
        except ValueError:
            slo = cls(0, 0)
        if not (slo.ttft_ms > 0 and slo.tpot_ms > 0):
            raise ValueError(f"{text!r}: give the SLO as TTFT/TPOT in ms, each above 0, e.g. 500/20")
        return slo


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
    """One request: its prompt and output tokens, and when it is sent (None: when the closed loop has room).

    A turn of a conversation after its first also says which it is and what it shares with the one
    before: ``earlier_prompt`` tokens of that turn's prompt, then its ``earlier_output`` answer tokens
    (the whole of both begin this prompt).
    """

    id: int
    prompt: int
    output: int
    sent_s: float | None
    conversation: int | None = None
    earlier_prompt: int = 0
    earlier_output: int = 0
    slo: SLO | None = None  # the targets this request asks for (a phase's); None: the run's


@dataclass(frozen=True)
class Workload:
    input_len: Lengths
    output_len: Lengths
    num_prompts: int
    concurrency: int | None = None  # closed loop: requests kept in flight (conversations, with turns)
    rate: float | None = None  # open loop: Poisson arrivals per second
    seed: int = 0
    turns: int = 1  # requests per conversation; 1: independent requests
    system_len: int = 0  # multi-turn: each conversation's system prompt, before its first user message
    salted: bool = False  # multi-turn: every request with a cache salt of its own (hybrid_pd.bench.multiturn --cache-salt): no hit
    slo: SLO | None = None  # the targets its requests ask for (a phase's, as the x-slo-* headers say); None: the run's

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give a concurrency or a rate, not both")
        if self.turns > 1 and self.concurrency is None:
            raise ValueError("multi-turn traffic is closed loop: give a concurrency (conversations at once)")
        if self.turns < 1 or self.system_len < 0:
            raise ValueError("turns must be 1 or more and the system prompt 0 tokens or more")

    @property
    def longest_request(self) -> int:
        """The most tokens one request holds: its prompt and its answer."""
        per_turn = self.input_len.high + self.output_len.high
        return self.system_len + self.turns * per_turn

    def requests(self) -> list[Request]:
        """The requests in the order they are sent; open-loop ones with their arrival times; conversations turn by turn."""
        if self.turns > 1:
            return self._conversations()
        rng = random.Random(self.seed)
        out, t = [], 0.0
        for i in range(self.num_prompts):
            sent = None
            if self.rate is not None:
                sent = t
                t += rng.expovariate(self.rate)
            out.append(Request(i, self.input_len.draw(rng), self.output_len.draw(rng), sent, slo=self.slo))
        return out

    def _conversations(self) -> list[Request]:
        """``num_prompts`` requests as whole conversations (rounded up to ``turns``), each conversation's turns in order."""
        rng = random.Random(self.seed)
        out: list[Request] = []
        for conversation in range(-(-self.num_prompts // self.turns)):
            history, earlier_prompt, earlier_output = self.system_len, 0, 0
            for _ in range(self.turns):
                prompt, output = history + self.input_len.draw(rng), self.output_len.draw(rng)
                out.append(Request(len(out), prompt, output, None, conversation, earlier_prompt, earlier_output, self.slo))
                history, earlier_prompt, earlier_output = prompt + output, prompt, output
        return out

    @property
    def load(self) -> str:
        if self.turns > 1:
            return f"{self.concurrency} conversations of {self.turns} turns in flight, system prompts of {self.system_len}"
        return f"{self.concurrency} in flight" if self.concurrency is not None else f"{self.rate:g} req/s"


def parse_phase(text: str, seed: int) -> Workload:
    """One closed-loop phase of a traffic that changes, ``IN/OUT@C[xN][:TTFT/TPOT]``: prompt and output tokens (each N or
    LOW-HIGH), C requests in flight, N requests (default :func:`default_prompts`), and the SLO its requests ask for (default:
    the run's); e.g. ``16000/256@32x192:4000/15``. ValueError names the form."""
    form = f"{text!r}: give a phase as IN/OUT@C[xN][:TTFT/TPOT], e.g. 1000/512@64x384:500/20 (IN and OUT: N or LOW-HIGH tokens)"
    text, _, targets = text.partition(":")
    slo = SLO.parse(targets) if targets else None
    lengths, _, load = text.partition("@")
    inputs, _, outputs = lengths.partition("/")
    concurrency, _, count = load.partition("x")
    try:
        c = int(concurrency)
        n = int(count) if count else default_prompts(c, None)
        if c < 1 or n < 1:
            raise ValueError
        return Workload(Lengths.parse(inputs), Lengths.parse(outputs), n, concurrency=c, seed=seed, slo=slo)
    except ValueError:
        raise ValueError(form) from None
