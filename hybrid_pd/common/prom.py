"""Reading vLLM's Prometheus text: sums of a series and labels of an info metric."""

from __future__ import annotations

import re

__all__ = ["cache_block_size", "histogram_mean", "metric_label", "metric_sum", "prefix_hit_tokens"]


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in a Prometheus text exposition."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def histogram_mean(before: str, after: str, name: str) -> tuple[float, float] | None:
    """The mean and count of histogram ``name``'s observations between two scrapes; None when it observed none."""
    count = metric_sum(after, f"{name}_count") - metric_sum(before, f"{name}_count")
    return ((metric_sum(after, f"{name}_sum") - metric_sum(before, f"{name}_sum")) / count, count) if count else None


def metric_label(text: str, name: str, label: str) -> str | None:
    """The value of ``label`` on the first sample of ``name`` (e.g. ``vllm:cache_config_info``)."""
    match = re.search(rf'^{re.escape(name)}\{{[^}}]*\b{re.escape(label)}="([^"]*)"', text, re.M)
    return match.group(1) if match else None


def _positive(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def cache_block_size(text: str) -> int | None:
    """The block size in vLLM's ``cache_config_info`` (the scheduler's; None when not exposed)."""
    return _positive(metric_label(text, "vllm:cache_config_info", "block_size"))


def prefix_hit_tokens(text: str, engine_block: int | None = None) -> int | None:
    """The granule at which vLLM's prefix-cache hits land; None when prefix caching is off (``cache_config_info``).

    For a hybrid that is the state checkpoint block, the attention block vLLM's engine raised
    until its page holds a Mamba page. The API server's ``cache_config_info`` shows the block
    size from before that (16 on vLLM 0.26 GPU: hits landed at 1,152), so ``engine_block``, the
    size the engine logged (:class:`hybrid_pd.worker.supervise.OutputRelay`), comes first; then
    what the engine handed back to the API server where vLLM does (``cache_hit_alignment_tokens``,
    ``effective_attention_block_size``), ``mamba_block_size``, and the block size.
    """
    if metric_label(text, "vllm:cache_config_info", "enable_prefix_caching") != "True":
        return None
    if engine_block:
        return engine_block
    for label in ("cache_hit_alignment_tokens", "effective_attention_block_size", "mamba_block_size", "block_size"):
        value = _positive(metric_label(text, "vllm:cache_config_info", label))
        if value is not None:
            return value
    return None
