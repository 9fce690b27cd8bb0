"""The recomputed token N as a decode row: vLLM's fix, its test-only removal, and our copy of it.

On a decode worker, token N of a P/D request (the last prompt token, recomputed from
the pulled h(N-1)) is a one-token prompt step with prior Mamba state. With FULL CUDA
graphs vLLM picks the graph by the batch's shape, so a batch of one-token rows replays
the *decode* graph, which reads the state of decode rows only. vLLM's Mamba metadata
builder therefore counts such a row as a decode row ("decode-row reclassification",
``BaseMambaAttentionMetadataBuilder._compute_common_metadata`` in
``vllm/v1/attention/backends/mamba_attn.py``: one-token prefills with prior state get
``is_prefilling`` False before ``split_decodes_and_prefills``). Without it the row counts
as a prefill, the graph runs without its state and the answer is fluent and wrong
(measured on an H200, vLLM 0.26.0: P/D 4.0% against colocated 93.5% on GSM8K).
Eager or PIECEWISE execution runs the prefill kernels with the initial state instead,
which is correct, only slower.

- :func:`probe` asks the installed builder how it classifies such a row (and a
  first one-token prompt chunk, which has no state and must stay a prefill).
- :func:`remove_vllm_fix` is the negative control, for tests only: it makes vLLM's
  builder ignore its own reclassification, which restores vLLM's behaviour before
  the fix. Our connector applies it when ``HYBRID_PD_TEST_ONLY_DISABLE_DECODE_ROW_FIX=1``.
- :func:`apply_fix` is the fallback for a vLLM without the fix: the same rule,
  applied to the builder's input. Our connector applies it when
  ``HYBRID_PD_APPLY_DECODE_ROW_FIX=1`` (the worker sets it: :mod:`hybrid_pd.connector.vllm.capabilities`).

Both patch vLLM's class in the process that imports this module (vLLM's engine, through
our connector module); no file of vLLM is changed.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

__all__ = ["apply_fix", "probe", "remove_vllm_fix"]

# Test only: a worker with this set answers wrongly on GPU with FULL CUDA graphs.

_METHOD = "_compute_common_metadata"
_PATCHED = "_hybrid_pd_decode_rows"  # marks our wrappers: which ones are on the method, innermost first


def _builder_class() -> type:
    from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder

    return BaseMambaAttentionMetadataBuilder


def _wrap(kind: str, make: Any) -> bool:
    """Put wrapper ``make(original)`` of ``kind`` around the builder's method, once. Returns False if already there."""
    cls = _builder_class()
    original = getattr(cls, _METHOD)
    applied = getattr(original, _PATCHED, ())
    if kind in applied:
        return False
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _PATCHED, (*applied, kind))
    setattr(cls, _METHOD, wrapper)
    return True


class _IgnoresPrefillingChanges:
    """Mixin for a copy of vLLM's ``CommonAttentionMetadata`` whose ``replace(is_prefilling=...)`` is a no-op."""

    def replace(self, **changes: Any) -> Any:
        original = self.__dict__["_hybrid_pd_original"]
        if changes.keys() == {"is_prefilling"}:
            return original  # vLLM's reclassification, dropped: the rows keep their prefill flags
        return original.replace(**changes)


@functools.cache
def _ignoring_class(cls: type) -> type:
    return type(f"_IgnoresPrefillingChanges{cls.__name__}", (_IgnoresPrefillingChanges, cls), {})


def _ignoring_prefilling_changes(metadata: Any) -> Any:
    clone = copy.copy(metadata)
    clone.__class__ = _ignoring_class(type(metadata))
    clone.__dict__["_hybrid_pd_original"] = metadata
    return clone


def remove_vllm_fix() -> bool:
    """TEST ONLY: vLLM's builder no longer turns a one-token prefill with prior state into a decode row.

    The builder's only ``replace(is_prefilling=...)`` is that reclassification; it is
    made a no-op, so the rows reach ``split_decodes_and_prefills`` as vLLM sees them
    before the fix. Returns False if already removed.
    """

    def make(original: Any) -> Any:
        def compute(self: Any, common_attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            return original(self, _ignoring_prefilling_changes(common_attn_metadata), *args, **kwargs)

        return compute

    return _wrap("removed", make)


def reclassified(metadata: Any) -> Any:
    """``metadata`` with every one-token prefill row that has prior state marked as not prefilling."""
    import torch

    is_prefilling = metadata.is_prefilling
    if is_prefilling is None:
        return metadata
    query_lens = torch.diff(metadata.query_start_loc_cpu)
    seq_lens = metadata.seq_lens_cpu_upper_bound
    if seq_lens is None:
        seq_lens = metadata.seq_lens.cpu()
    to_decode = is_prefilling & (query_lens == 1) & (seq_lens > query_lens)
    if not bool(torch.any(to_decode)):
        return metadata
    flags = is_prefilling.clone()
    flags[to_decode] = False
    return metadata.replace(is_prefilling=flags)


def apply_fix() -> bool:
    """The fallback: our copy of the reclassification, applied to the builder's input. False if already applied.

    Outermost, so it also holds with :func:`remove_vllm_fix` underneath (the GPU
    negative control plus this fallback). Speculative decoding's padded prompt tails
    (vLLM 0.32 reclassifies those too) are not covered.
    """

    def make(original: Any) -> Any:
        def compute(self: Any, common_attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            return original(self, reclassified(common_attn_metadata), *args, **kwargs)

        return compute

    return _wrap("applied", make)


class _Split(Exception):
    def __init__(self, counts: tuple[int, int, int, int]) -> None:
        super().__init__(counts)
        self.counts = counts


def probe() -> dict[str, str]:
    """How the installed builder classifies two one-token prompt rows: ``{"stateful": ..., "first": ...}``.

    ``stateful`` is token N after a pull (99 tokens of state before it), ``first`` a
    one-token prompt's first chunk (no state); each is ``"decode"`` or ``"prefill"``
    as vLLM's own ``split_decodes_and_prefills`` counts it inside the builder. The
    builder is stopped right after that split; nothing else of it runs.
    """
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends import mamba_attn
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

    builder = object.__new__(Mamba2AttentionMetadataBuilder)  # the method reads no builder state up to the split
    rows = {"stateful": 100, "first": 1}  # seq_len of each one-token row, in vLLM's batch order
    n = len(rows)
    query_start = torch.arange(n + 1, dtype=torch.int32)
    seq_lens = torch.tensor(list(rows.values()), dtype=torch.int32)
    metadata = CommonAttentionMetadata(
        query_start_loc=query_start,
        query_start_loc_cpu=query_start,
        seq_lens=seq_lens,
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.zeros((n, 1), dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        is_prefilling=torch.ones(n, dtype=torch.bool),
        seq_lens_cpu_upper_bound=seq_lens,
    )
    real_split = mamba_attn.split_decodes_and_prefills

    def split(*args: Any, **kwargs: Any) -> Any:
        raise _Split(real_split(*args, **kwargs))

    mamba_attn.split_decodes_and_prefills = split
    try:
        builder._compute_common_metadata(metadata)
    except _Split as stop:
        num_decodes = stop.counts[0]
    else:
        raise RuntimeError("the Mamba metadata builder no longer calls split_decodes_and_prefills")
    finally:
        mamba_attn.split_decodes_and_prefills = real_split
    # vLLM's batches put decode rows first, so the first num_decodes rows are the decodes.
    return {name: "decode" if i < num_decodes else "prefill" for i, name in enumerate(rows)}
