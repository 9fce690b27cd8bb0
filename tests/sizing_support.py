"""A small profile whose numbers a test can follow by hand (the sizing tests share it)."""

from __future__ import annotations

from typing import Any

from hybrid_pd.connector.plan import ModelShape
from hybrid_pd.sizing.profile import Profile

# Two Mamba2 layers and one attention layer: a Mamba layer's state (4,672 B) is the page; a 16-token block is one page.
SHAPE = ModelShape(
    mamba_layers=2, attention_layers=1, d_inner=64, groups_state=16, conv_rows=3, mamba_heads=4, mamba_head_dim=16,
    state_size=16, kv_heads=1, head_dim=16, dtype_bytes=2, ssm_dtype_bytes=4,
)  # fmt: skip
PAGE = 4672


def tiny_profile(**changes: Any) -> Profile:
    """Step = 5 + 0.5 x rows + 0.001 x context tokens + 0.01 x prompt tokens (ms); prompt latency 10 ms at 0 tokens, 20 at 1000."""
    fields: dict[str, Any] = {
        "model": "tiny", "device": "test", "source": "tests/sizing_support.py", "shape": SHAPE, "block_tokens": 16,
        "cache_bytes": 64 << 20, "max_num_seqs": 64, "max_num_batched_tokens": 4096,
        "decode": {"base_ms": 5.0, "per_seq_ms": 0.5, "per_context_token_ms": 0.001}, "prefill_per_token_ms": 0.01,
        "prompt_latency_ms": [(0, 10.0), (1000, 20.0)], "handoff_ms": 3.0, "transfer": {"latency_ms": 1.0, "bandwidth_gbps": 1.0},
    }  # fmt: skip
    return Profile.model_validate({**fields, **changes})
