"""``hybrid-pd profile``'s plan and fit: which measurements one server gets, and the profile they give.

The plan (:class:`Plan`, :data:`FULL` or :data:`QUICK`) is shaped to the server first
(:meth:`Plan.shaped`): prompts that fit its model length, batches that fit its ``max_num_seqs``
and KV cache without preemption, outputs long enough for a full batch to decode after the last
prompt is computed. The measurements (:mod:`.measure`) are fitted as :mod:`.fitting` fits every
profile (:func:`fit_profile`):

- decode step: the full batches' step times against rows and context (least squares);
- prefill per token: the cost at which the simulator serves the prefill burst at its measured
  throughput, the lone TTFTs less their prefill steps being the prompt latency;
- transfer: vLLM's own NIXL counters per prompt length, given a P/D router and its decode
  workers; else, or when they cannot be measured or fitted (on CPU a transfer's time can shrink
  as its bytes grow), the base profile's (the JSON's ``source`` says so);
- hand-off: always the base profile's (one server has none).

Memory and scheduler fields are the server's settings: ``--kv-cache-memory-bytes`` from its
``vllm:cache_config_info``, the others as given (vLLM exports them nowhere).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hybrid_pd.connector.plan import ModelShape, plan_transfer
from hybrid_pd.sizing.fitting import fit_decode_step, fit_transfer, match_throughput, prompt_latency_residue
from hybrid_pd.sizing.layouts import Layout
from hybrid_pd.sizing.measure import DecodePoint
from hybrid_pd.sizing.profile import MambaCacheMode, Profile, Transfer
from hybrid_pd.sizing.workload import Lengths, Workload

__all__ = ["FULL", "QUICK", "Measurements", "Plan", "Settings", "attention_block_tokens", "burst_workload", "fit_profile"]


@dataclass(frozen=True)
class Plan:
    """What to measure (tokens, requests); :meth:`shaped` fits it to a server."""

    prompt_lens: tuple[int, ...]  # lone TTFT, one request at a time (the transfers too)
    repeats: int  # lone requests per length; prefill bursts
    burst_prompt_len: int
    burst_budgets: int  # prompt tokens in a burst, in token budgets (steps of full prefill)
    decode_prompt_lens: tuple[int, ...]  # contexts of the decode points
    decode_rows: tuple[int, ...]  # batches of the decode points, at each of their contexts
    decode_output_len: int  # at least; more where the batch's prompts take longer to compute
    warmup: int = 2
    max_model_len: int = 1 << 20  # the server's, once :meth:`shaped`

    def shaped(self, server: Profile, max_model_len: int) -> Plan:
        """The plan within the server's model length (``server``: a profile of its settings)."""
        limit = max_model_len - 1
        longest = max(self.decode_rows)
        lone = max_model_len - 2  # the transfers are measured at these lengths too, with 2 output tokens (a P/D request decodes)
        return replace(
            self, max_model_len=max_model_len, prompt_lens=tuple(sorted({min(n, lone) for n in self.prompt_lens})), burst_prompt_len=min(self.burst_prompt_len, limit),
            decode_prompt_lens=tuple(sorted({max(1, min(n, limit - self.output_len_for(longest, n, server))) for n in self.decode_prompt_lens})),
        )  # fmt: skip

    def decode_batches(self, server: Profile) -> list[tuple[int, int]]:
        """(prompt tokens, rows) of each decode point: rows within the server's sequences and KV cache (none waits for memory)."""
        out: list[tuple[int, int]] = []
        for n in self.decode_prompt_lens:
            for r in self.decode_rows:
                point = (n, min(r, server.max_num_seqs, _fitting(server, n + self.output_len_for(r, n, server))))
                if point not in out:
                    out.append(point)
        return out

    def burst_requests(self, server: Profile) -> int:
        """Prompts in a burst: ``burst_budgets`` token budgets' worth, within the server's sequences and cache."""
        want = math.ceil(self.burst_budgets * server.max_num_batched_tokens / self.burst_prompt_len)
        return max(2, min(want, server.max_num_seqs, _fitting(server, self.burst_prompt_len + 1)))

    def output_len_for(self, rows: int, prompt_len: int, server: Profile) -> int:
        """Enough tokens that the batch decodes whole for ``decode_output_len`` steps after its prompts' steps."""
        return self.decode_output_len + math.ceil(rows * prompt_len / server.max_num_batched_tokens)

    def decode_tries(self, rows: int, prompt_len: int, server: Profile, tries: int) -> list[int]:
        """The output tokens of each try at a decode point: twice the last's after a batch that did not decode together.

        A batch decodes together only if its requests start within its decode's time; on a busy
        host (CI: the server and the client on two cores) one request can start after a short
        batch is done, so each try gives the batch longer, within the model's length and the KV
        cache (no row waits for memory).
        """
        outs = [self.output_len_for(rows, prompt_len, server)]
        for _ in range(tries - 1):
            longer = 2 * outs[-1]
            fits = prompt_len + longer < self.max_model_len and _fitting(server, prompt_len + longer) >= rows
            outs.append(longer if fits else outs[-1])
        return outs


def _fitting(server: Profile, tokens: int) -> int:
    """How many sequences of ``tokens`` tokens the server's KV cache holds at once.

    Less one attention block: vLLM keeps a block of its pool as the null block (an H200 profile
    asked 72 rows of 355 tokens of 8 GiB that held 71, and one request waited every try).
    """
    return max(1, (server.cache_bytes - server.memory_layout()[1]) // server.memory_bytes(tokens))


FULL = Plan((128, 512, 1024, 2048, 4096, 8192), 3, 2048, 8, (256, 3000), (1, 8, 32, 64, 128), 96)
QUICK = Plan((32, 256, 1024), 2, 256, 2, (32, 512), (1, 4, 8), 96, warmup=1)


@dataclass(frozen=True)
class Settings:
    """The server as the profile describes it: the model's shape and vLLM's memory and scheduler settings."""

    model: str
    device: str
    shape: ModelShape
    block_tokens: int
    cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int = 1
    mamba_cache_mode: MambaCacheMode = "none"

    def draft(self, base: Profile) -> Profile:
        """A profile of these settings, the rest from ``base`` until fitted."""
        return base.model_copy(update={"model": self.model, "device": self.device, "shape": self.shape, "block_tokens": self.block_tokens,
                                       "cache_bytes": self.cache_bytes, "max_num_seqs": self.max_num_seqs,
                                       "max_num_batched_tokens": self.max_num_batched_tokens, "tensor_parallel_size": self.tensor_parallel_size,
                                       "mamba_cache_mode": self.mamba_cache_mode})  # fmt: skip


def attention_block_tokens(shape: ModelShape, align: int = 16) -> int:
    """vLLM's attention block for a hybrid: the fewest tokens, a multiple of ``align``, whose attention page holds a Mamba layer's state.

    vLLM pages every layer alike and raises the attention block until its page is at least the
    state's (Nemotron-H-8B on an H100: 1040 tokens, as its NIXL registration logged).
    """
    one = plan_transfer(shape, 1025, block_size=1024)  # a prompt that moves one whole block (shorter ones move nothing)
    state = one.conv_bytes_per_mamba_layer + one.ssm_bytes_per_mamba_layer
    per_token = one.kv_bytes_per_attention_layer / 1024
    return align * max(1, math.ceil(state / per_token / align))


@dataclass(frozen=True)
class Measurements:
    """Everything one ``hybrid-pd profile`` run measured (ms, tokens), as :mod:`.measure` returns it."""

    lone_ttft_ms: dict[int, list[float]]
    burst_prompt_len: int
    burst_requests: int
    burst_rps: list[float]  # one per burst
    decode: list[DecodePoint]
    transfers: list[tuple[float, float]]  # (bytes, ms) per prompt length; empty: not measured
    transfer_error: str | None = None  # why the transfers asked for were not measured or not fitted (the base profile's is kept)
    decode_left_out: list[str] = field(default_factory=list)  # decode points whose batch never decoded together, and why

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def burst_workload(m: Measurements) -> Workload:
    """The burst as the simulator's traffic: its requests all sent at once, one output token each."""
    n = Lengths(m.burst_prompt_len, m.burst_prompt_len)
    return Workload(n, Lengths(1, 1), m.burst_requests, concurrency=m.burst_requests)


def fit_profile(m: Measurements, settings: Settings, base: Profile, source: str) -> Profile:
    """The profile of the module docstring; ``base`` gives the hand-off, and the transfer when none was measured."""
    transfer: Transfer = fit_transfer(m.transfers) if m.transfers and m.transfer_error is None else base.transfer
    draft = settings.draft(base).model_copy(update={
        "source": source, "decode": fit_decode_step([(d.rows, d.context, d.step_ms) for d in m.decode]), "transfer": transfer,
    })  # fmt: skip

    def with_prefill(per_token: float) -> Profile:
        p = draft.model_copy(update={"prefill_per_token_ms": per_token})
        return p.model_copy(update={"prompt_latency_ms": prompt_latency_residue(p, m.lone_ttft_ms)})

    high = max(max(v) / n for n, v in m.lone_ttft_ms.items())  # no token costs more than a lone prompt's whole TTFT
    rps = sum(m.burst_rps) / len(m.burst_rps)
    one_worker = Layout("replicas", 0, 1, settings.tensor_parallel_size, settings.tensor_parallel_size)  # the server measured
    return match_throughput(with_prefill, one_worker, burst_workload(m), rps, high)
