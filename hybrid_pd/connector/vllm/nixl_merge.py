"""Post fewer, larger NIXL descriptors: merge the reads that are adjacent on both sides.

vLLM's NIXL connector reads a Mamba layer's state of one block as four descriptors:
the conv state's x, B and C slices (the DS layout's three reads, needed to split
them across TP ranks) and the SSM state. In the cache page they lie back to back,
on the prefill and on the decode side alike, yet each is posted, and paid for, on
its own: NIXL costs ~6 us of CPU per descriptor to post on a GPU (measured:
34 descriptors 0.21 ms, the same bytes as 10 merged descriptors 0.08 ms, one 0.02 ms;
``hybrid_pd/bench/nixl_floor.py``), and the decode engine posts every pull of a step
before it runs the step.

The merge works at the NIXL API, below vLLM, on vLLM's own descriptor lists:

1. when a descriptor list is prepared, each maximal run of 2 to ``MAX_RUN``
   address-adjacent descriptors gets one more entry covering the whole run,
   appended after vLLM's entries (whose indices stay valid);
2. when a transfer is made from two prepared lists, each run of posted pairs that
   are adjacent on both sides and match such an entry on both sides is replaced
   by the two merged entries. Everything else is posted as vLLM asked.

The bytes moved are the same; only the number of descriptors drops (vLLM's
``vllm:nixl_num_descriptors`` shows it). Longer runs (consecutive attention blocks
of one region) are left to vLLM, which already merges adjacent blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybrid_pd.connector.vllm.nixl_trace import descriptor_tuples

__all__ = ["MAX_RUN", "adjacent_runs", "merge_adjacent_descriptors", "merge_indices"]

MAX_RUN = 8  # a Mamba layer's block is 4 pieces (x, B, C, SSM); longer runs are attention blocks


@dataclass
class _Prepared:
    """A prepared descriptor list as the merge sees it."""

    addrs: list[int]
    lengths: list[int]
    merged: dict[tuple[int, int], int] = field(default_factory=dict)  # (start, length) of a run -> its entry


def adjacent_runs(tuples: list[list[int]]) -> list[tuple[int, int, int]]:
    """(address, length, device) of every maximal run of 2 to ``MAX_RUN`` address-adjacent descriptors."""
    order = sorted(range(len(tuples)), key=lambda i: (tuples[i][2], tuples[i][0]))
    runs = []
    i = 0
    while i < len(order):
        start, length, device = tuples[order[i]]
        end, j = start + length, i
        while j + 1 < len(order) and tuples[order[j + 1]][2] == device and tuples[order[j + 1]][0] == end:
            j += 1
            end += tuples[order[j]][1]
        if 2 <= j - i + 1 <= MAX_RUN:
            runs.append((start, end - start, device))
        i = j + 1
    return runs


def merge_indices(local: _Prepared, remote: _Prepared, local_idx: list[int], remote_idx: list[int]) -> tuple[list[int], list[int]]:
    """The transfer's index lists with every run adjacent on both sides replaced by its merged entries."""
    out_local, out_remote = [], []
    p, n = 0, len(local_idx)
    while p < n:
        q = p
        while (
            q + 1 < n
            and q + 1 - p < MAX_RUN
            and local.addrs[local_idx[q]] + local.lengths[local_idx[q]] == local.addrs[local_idx[q + 1]]
            and remote.addrs[remote_idx[q]] + remote.lengths[remote_idx[q]] == remote.addrs[remote_idx[q + 1]]
        ):
            q += 1
        if q > p:
            length = sum(local.lengths[i] for i in local_idx[p : q + 1])
            ml = local.merged.get((local.addrs[local_idx[p]], length))
            mr = remote.merged.get((remote.addrs[remote_idx[p]], length))
            if ml is not None and mr is not None:
                out_local.append(ml)
                out_remote.append(mr)
                p = q + 1
                continue
        out_local.append(local_idx[p])
        out_remote.append(remote_idx[p])
        p += 1
    return out_local, out_remote


def merge_adjacent_descriptors() -> type:
    """Merge adjacent descriptors in every transfer NIXL agents of this process make from now on.

    Returns the agent class that was patched (vLLM's ``NixlWrapper``).
    """
    from vllm.distributed.nixl_utils import NixlWrapper  # the NIXL flavour vLLM picked (cu12, cu13, rocm)

    if NixlWrapper is None:
        raise RuntimeError("NIXL is not importable in this process")
    if getattr(NixlWrapper, "_hybrid_pd_merging", False):
        return NixlWrapper
    cls = NixlWrapper
    orig_get, orig_prep, orig_make = cls.get_xfer_descs, cls.prep_xfer_dlist, cls.make_prepped_xfer
    lists: dict[int, tuple[Any, list, str | None]] = {}  # id(descriptor list) -> (it, its tuples, memory type)
    prepared: dict[int, tuple[Any, _Prepared]] = {}  # id(prepared handle) -> (it, what the merge knows)

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        out = orig_get(self, descs, mem_type)
        if (tuples := descriptor_tuples(descs)) is not None:
            lists[id(out)] = (out, tuples, mem_type)
        return out

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: str | None = None, backends: list[str] = []) -> Any:  # noqa: B006 - NIXL's signature
        known = lists.pop(id(xfer_list), None)  # vLLM prepares each list it builds once
        tuples, kind = (known[1], known[2]) if known else (descriptor_tuples(xfer_list), mem_type)
        runs = adjacent_runs(tuples) if tuples and kind else []
        if not runs:
            return orig_prep(self, agent_name, xfer_list, mem_type, backends)
        extended = orig_get(self, [tuple(t) for t in tuples] + runs, kind)
        handle = orig_prep(self, agent_name, extended, None, backends)
        view = _Prepared([t[0] for t in tuples] + [r[0] for r in runs], [t[1] for t in tuples] + [r[1] for r in runs])
        view.merged = {(start, length): len(tuples) + k for k, (start, length, _dev) in enumerate(runs)}
        prepared[id(handle)] = (handle, view)
        return handle

    def make_prepped_xfer(self, operation: str, local: Any, local_indices: Any, remote: Any, remote_indices: Any, *args: Any, **kwargs: Any) -> Any:
        mine, theirs = prepared.get(id(local)), prepared.get(id(remote))
        if mine is not None and theirs is not None:
            local_indices, remote_indices = merge_indices(mine[1], theirs[1], [int(i) for i in local_indices], [int(i) for i in remote_indices])
        return orig_make(self, operation, local, local_indices, remote, remote_indices, *args, **kwargs)

    cls.get_xfer_descs, cls.prep_xfer_dlist, cls.make_prepped_xfer = get_xfer_descs, prep_xfer_dlist, make_prepped_xfer
    cls._hybrid_pd_merging = True
    return cls
