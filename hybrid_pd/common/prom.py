"""Reading vLLM's Prometheus text: sums of a series and labels of an info metric."""

from __future__ import annotations

import re

__all__ = ["metric_label", "metric_sum"]


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in a Prometheus text exposition."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def metric_label(text: str, name: str, label: str) -> str | None:
    """The value of ``label`` on the first sample of ``name`` (e.g. ``vllm:cache_config_info``)."""
    match = re.search(rf'^{re.escape(name)}\{{[^}}]*\b{re.escape(label)}="([^"]*)"', text, re.M)
    return match.group(1) if match else None
