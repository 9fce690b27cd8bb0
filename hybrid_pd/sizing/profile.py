"""A model's serving profile on one GPU (or CPU): what the sizing simulator knows of a vLLM worker.

One JSON file (:meth:`Profile.load`, :meth:`Profile.save`). Each quantity has the simplest form
the measurements behind it support, so that a profile can be fitted from a handful of runs and
each number read on its own:

- **Step time** (:meth:`Profile.step_ms`): a decode step reads the weights once (``base_ms``),
  each sequence's Mamba state (``per_seq_ms`` a row) and each attention layer's KV
  (``per_context_token_ms`` per token of context of those rows); every prompt token computed in
  the same step (chunked prefill mixes them in) adds ``prefill_per_token_ms``. Linear, because
  prefill at full token budget is compute-bound and a decode step is bandwidth-bound, and because
  a mixed step then costs what its parts cost: no regime boundary to fit. Each prompt in the
  step adds ``prefill_per_prompt_ms`` besides its tokens (default 0): the four-H100 run's waves of
  1000-token prompts, eight to a step, took ~0.029 ms a token while one prefill worker computed
  16000- and 32000-token prompts at ~0.0265, so a prompt costs something of its own (the Mamba
  scan works in chunks, a prompt's last one partly empty); without it the replicas' TTFT under
  load was ~100 ms short and their goodput at a 500 ms target 1.8x too high.
- **Prompt latency** (:meth:`Profile.prompt_latency_ms`): the time a prompt's first token takes
  beyond the engine's step, holding no GPU (what a lone request's TTFT has over its step: the
  server's frontend, and whatever else a measurement shows). A piecewise-linear table over prompt
  tokens, held flat beyond its ends: it is fitted from a few prompt lengths and has no shape
  worth extrapolating.
- **Hand-off** (``handoff_ms``): what P/D adds to a request besides the transfer and the decode
  worker's step (the second leg's HTTP hops and frontend, the prefill's answer); fixed.
- **Transfer** (:meth:`Profile.transfer_ms`): ``latency_ms + bytes / bandwidth``, the bytes of one
  request from :func:`hybrid_pd.connector.plan.plan_transfer` (to the byte what vLLM moves).
- **Memory** (:meth:`Profile.memory_bytes`): vLLM's hybrid KV cache in pages of one size (an
  attention block's, or a Mamba layer's state if larger): a sequence holds a page per Mamba layer
  slot for its state and, per ``block_tokens`` tokens, a page per attention layer slot. The cache
  holds ``cache_bytes``; so the state slots bound a worker's concurrency as well as KV does.
  With prefix caching in vLLM's Mamba cache mode ``all`` (vLLM 0.26's default for Nemotron-H when
  caching is on) a sequence keeps its state at every block: a page per Mamba layer slot *per
  block* as well (on an H200, 8 GiB held 16.25 sequences of 4096 tokens, not 50.4). ``align``
  keeps one running state, as ``none`` does.
- **Scheduler** (``max_num_seqs``, ``max_num_batched_tokens``): the vLLM settings the profile was
  measured with; its step times hold for them.
- **Tensor parallelism** (``tensor_parallel_size``): the GPUs of the worker measured. Every figure
  is the worker's as a whole (``cache_bytes`` over all its GPUs), so a worker of 2 GPUs has a
  profile of its own, measured as it runs: how its step time scales is the GPUs' interconnect's,
  not a rule to assume. ``hybrid-pd size`` lays out workers of each size it has a profile of
  (:func:`profile_set`).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hybrid_pd.connector.plan import ModelShape, TransferPlan, plan_transfer

__all__ = [
    "MAMBA_CACHE_MODES",
    "SHIPPED",
    "DecodeStep",
    "MambaCacheMode",
    "Profile",
    "ProfileError",
    "Profiles",
    "Transfer",
    "profile_path",
    "profile_set",
    "shipped_profiles",
]

MambaCacheMode = Literal["none", "align", "all"]  # vLLM's CacheConfig.mamba_cache_mode
MAMBA_CACHE_MODES: tuple[str, ...] = get_args(MambaCacheMode)
# Profiles measured by this project, shipped with it: a flag that takes a profile takes one of their names.
SHIPPED = Path(__file__).resolve().parent / "profiles"


def shipped_profiles() -> list[str]:
    """The names of the shipped profiles (``profiles/NAME.json``)."""
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def profile_path(value: str) -> Path:
    """A profile given as a shipped profile's name or a path; :class:`ProfileError` when neither exists."""
    path = SHIPPED / f"{value}.json" if value in shipped_profiles() else Path(value)
    if not path.is_file():
        raise ProfileError(f"no profile {value!r}: give a hybrid-pd profile JSON (hybrid-pd profile) or one of {', '.join(shipped_profiles())}")
    return path


class ProfileError(ValueError):
    """A profile file that cannot be read or is not valid; the message names the file and the field."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DecodeStep(_Frozen):
    """A step's time without prompt tokens: ``base_ms + per_seq_ms x rows + per_context_token_ms x context tokens``."""

    base_ms: float = Field(ge=0)
    per_seq_ms: float = Field(ge=0)
    per_context_token_ms: float = Field(ge=0)


class Transfer(_Frozen):
    """One request's state pulled by the decode worker: ``latency_ms + bytes / bandwidth``."""

    latency_ms: float = Field(ge=0)
    bandwidth_gbps: float = Field(gt=0)  # GB/s (1e9 bytes)

    def ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes / (self.bandwidth_gbps * 1e6)


class Profile(_Frozen):
    """One model on one device, as the simulator's workers run it (module docstring: each field's form and why)."""

    model: str
    device: str
    source: str  # how the numbers were obtained: measured by which command, or fitted from which runs
    shape: ModelShape
    block_tokens: int = Field(gt=0)  # vLLM's attention block size for this model
    cache_bytes: int = Field(gt=0)  # vLLM's KV cache (--kv-cache-memory-bytes), over all the worker's GPUs
    max_num_seqs: int = Field(gt=0)
    max_num_batched_tokens: int = Field(gt=0)
    decode: DecodeStep
    prefill_per_token_ms: float = Field(ge=0)
    prefill_per_prompt_ms: float = Field(0.0, ge=0)  # each prompt (or chunk of one) in a step, besides its tokens
    prompt_latency_ms: list[tuple[int, float]] = Field(min_length=1)  # (prompt tokens, ms), tokens increasing
    handoff_ms: float = Field(ge=0)
    transfer: Transfer
    tensor_parallel_size: int = Field(1, gt=0)  # the worker's GPUs
    mamba_cache_mode: MambaCacheMode = "none"  # vLLM's (cache_config_info): "all" keeps a state per block

    @field_validator("prompt_latency_ms")
    @classmethod
    def _increasing(cls, points: list[tuple[int, float]]) -> list[tuple[int, float]]:
        xs = [x for x, _ in points]
        if any(b <= a for a, b in zip(xs, xs[1:])) or any(y < 0 for _, y in points):
            raise ValueError("give [tokens, ms] points with tokens increasing and ms >= 0")
        return points

    def step_ms(self, rows: int, context_tokens: int, prompt_tokens: int, prompts: int = 0) -> float:
        """One engine step: ``rows`` decode rows over ``context_tokens`` tokens of context, and ``prompt_tokens`` tokens of ``prompts`` prompts."""
        d = self.decode
        prefill = self.prefill_per_token_ms * prompt_tokens + self.prefill_per_prompt_ms * prompts
        return d.base_ms + d.per_seq_ms * rows + d.per_context_token_ms * context_tokens + prefill

    def prompt_latency_ms_at(self, tokens: int) -> float:
        """The prompt latency table at ``tokens``: linear between its points, flat beyond its ends."""
        xs = [x for x, _ in self.prompt_latency_ms]
        i = bisect.bisect_left(xs, tokens)
        if i == 0:
            return self.prompt_latency_ms[0][1]
        if i == len(xs):
            return self.prompt_latency_ms[-1][1]
        (x0, y0), (x1, y1) = self.prompt_latency_ms[i - 1], self.prompt_latency_ms[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def transfer_plan(self, prompt_tokens: int, decode_cached: int = 0, prefill_tp: int | None = None) -> TransferPlan:
        """What one request of ``prompt_tokens`` moves to this profile's worker as the decode worker (none: it computes the
        prompt itself), less the ``decode_cached`` tokens of whole blocks its prefix cache holds, from a prefill worker
        of ``prefill_tp`` GPUs (default: its own size). The bytes are the ranks' together, replicas included
        (KV heads fewer than ranks)."""
        tp = self.tensor_parallel_size
        return _plan(self.shape, prompt_tokens, self.block_tokens, decode_cached, prefill_tp or tp, tp)

    def transfer_ms(self, prompt_tokens: int, decode_cached: int = 0) -> float:
        return self.transfer.ms(self.transfer_plan(prompt_tokens, decode_cached).total_bytes)

    def memory_layout(self) -> tuple[int, int]:
        """(bytes a sequence's state holds, bytes each ``block_tokens`` of its tokens hold) in vLLM's hybrid KV cache.

        In Mamba cache mode ``all`` the state is held per block: nothing once, both per block.
        """
        tp = self.tensor_parallel_size  # the worker's ranks together
        one = _plan(self.shape, self.block_tokens + 1, self.block_tokens, 0, tp, tp)  # a prompt that moves exactly one block
        page = max(one.kv_bytes_per_attention_layer, one.conv_bytes_per_mamba_layer + one.ssm_bytes_per_mamba_layer)
        state, block = page * one.mamba_layers_moved, page * one.attention_layers_moved
        return (0, state + block) if self.mamba_cache_mode == "all" else (state, block)

    def memory_bytes(self, tokens: int) -> int:
        """The KV cache a sequence of ``tokens`` tokens holds."""
        state, block = self.memory_layout()
        return state + block * math.ceil(tokens / self.block_tokens)

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProfileError(f"cannot read {path} as a profile: {exc}") from None
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}" for e in exc.errors())
            raise ProfileError(f"{path} is not a valid profile: {problems}") from None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=1) + "\n")


# One model's profiles by the tensor-parallel size of the worker each was measured on.
Profiles = dict[int, Profile]


def profile_set(profiles: list[Profile]) -> Profiles:
    """Profiles of one model on workers of different sizes, by size; ProfileError unless they can serve side by side.

    Workers of different sizes exchange state only where the router pairs them: the same model
    (its shape) and block size, one size dividing the other (:func:`hybrid_pd.connector.compat.tp_sizes_pair`,
    checked per layout). One profile per size: two of one size would leave the simulator to pick.
    """
    out: Profiles = {}
    for p in profiles:
        if p.tensor_parallel_size in out:
            raise ProfileError(f"two profiles of tensor_parallel_size {p.tensor_parallel_size}: give one per size")
        first = next(iter(out.values()), p)
        if (p.shape, p.block_tokens) != (first.shape, first.block_tokens):
            raise ProfileError(
                f"the profiles of tensor_parallel_size {first.tensor_parallel_size} and {p.tensor_parallel_size} differ in the model's "
                "shape or block_tokens: workers pair only when they serve the same model with the same block size"
            )
        out[p.tensor_parallel_size] = p
    return out


@functools.lru_cache(maxsize=4096)
def _plan(shape: ModelShape, prompt_tokens: int, block_tokens: int, decode_cached: int = 0, prefill_tp: int = 1, decode_tp: int = 1) -> TransferPlan:
    """The transfer plan at one prompt length (a request's bytes; one page's bytes): the same few lengths recur."""
    return plan_transfer(shape, prompt_tokens, prefill_tp, decode_tp, block_size=block_tokens, decode_cached_tokens=decode_cached)
