"""Adjacent NIXL descriptors are merged on both sides, and the bytes still land where vLLM asked.

The rules are tested on descriptor lists; the last case runs two real NIXL agents
in a fresh process, lays out state the way vLLM's cache pages hold it (x, B, C and
SSM back to back per block, pages padded, attention blocks contiguous) and reads it
the way vLLM's connector does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybrid_pd.connector.vllm.nixl_merge import MAX_RUN, _Prepared, adjacent_runs, merge_indices


def _page(base: int) -> list[list[int]]:
    """One Mamba block: x, B, C and SSM back to back (device 0)."""
    return [[base, 300, 0], [base + 300, 100, 0], [base + 400, 100, 0], [base + 500, 1000, 0]]


def test_runs_are_maximal_adjacent_groups_of_two_to_max_run():
    tuples = _page(0) + _page(4096) + [[10_000, 50, 0]]  # a lone descriptor: no run
    assert adjacent_runs(tuples) == [(0, 1500, 0), (4096, 1500, 0)]
    contiguous = [[100_000 + 10 * i, 10, 0] for i in range(MAX_RUN + 1)]  # attention blocks of a region: too long
    assert adjacent_runs(contiguous) == []
    assert adjacent_runs([[0, 10, 0], [10, 10, 1]]) == [], "different devices never merge"
    assert adjacent_runs(list(reversed(_page(0)))) == [(0, 1500, 0)], "list order does not matter"


def _prepared(tuples: list[list[int]]) -> _Prepared:
    runs = adjacent_runs(tuples)
    view = _Prepared([t[0] for t in tuples] + [r[0] for r in runs], [t[1] for t in tuples] + [r[1] for r in runs])
    view.merged = {(start, length): len(tuples) + k for k, (start, length, _d) in enumerate(runs)}
    return view


def test_a_run_adjacent_on_both_sides_becomes_one_pair_and_others_stay():
    local = _prepared(_page(0) + _page(4096))  # merged entries 8 and 9
    remote = _prepared(_page(50_000) + _page(60_000))
    assert merge_indices(local, remote, [0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 0, 1, 2, 3]) == ([8, 9], [9, 8])
    # Only part of a run is posted: it matches no merged entry, so it goes as posted.
    assert merge_indices(local, remote, [0, 1], [0, 1]) == ([0, 1], [0, 1])
    # Adjacent locally but not remotely (x of one block with B of another): as posted.
    assert merge_indices(local, remote, [0, 1, 2, 3], [0, 5, 6, 7]) == ([0, 1, 2, 3], [0, 5, 6, 7])


_AGENTS = """
import os, sys
os.environ.update(UCX_TLS="tcp,self,sm", UCX_NET_DEVICES="lo")
import numpy as np, torch
merge = sys.argv[1] == "1"
if merge:
    from hybrid_pd.connector.vllm.nixl_merge import merge_adjacent_descriptors
    merge_adjacent_descriptors()
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

PAGE, BLOCKS = 4096, 6
def layout(buf):  # per block: x, B, C, SSM back to back, then padding; then 3 attention blocks, contiguous
    base = buf.data_ptr()
    descs = []
    for b in range(BLOCKS):
        p = base + b * PAGE
        descs += [(p, 768, 0), (p + 768, 256, 0), (p + 1024, 256, 0), (p + 1280, 2048, 0)]
    attn = base + BLOCKS * PAGE
    descs += [(attn + b * 1024, 1024, 0) for b in range(3)]
    return descs

size = BLOCKS * PAGE + 3 * 1024
src = torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8)
dst = torch.zeros(size, dtype=torch.uint8)
config = nixl_agent_config(num_threads=4, capture_telemetry=True)
target, initiator = NixlWrapper("target", config), NixlWrapper("initiator", config)
for agent, buf in ((target, src), (initiator, dst)):
    agent.register_memory(agent.get_reg_descs([(buf.data_ptr(), size, 0, "")], "DRAM"))
peer = initiator.add_remote_agent(target.get_agent_metadata())
local = initiator.prep_xfer_dlist("NIXL_INIT_AGENT", initiator.get_xfer_descs(np.array(layout(dst)), "DRAM"))
remote = initiator.prep_xfer_dlist(peer, initiator.get_xfer_descs(np.array(layout(src)), "DRAM"))
# A request's pull as vLLM posts it: blocks 1 and 4 of the Mamba region (read into local blocks 2 and 0)
# and attention blocks 0 and 1.
lidx = [8, 9, 10, 11, 0, 1, 2, 3, 24, 25]
ridx = [4, 5, 6, 7, 16, 17, 18, 19, 24, 25]
handle = initiator.make_prepped_xfer("READ", local, np.array(lidx), remote, np.array(ridx))
state = initiator.transfer(handle)
while state != "DONE":
    assert state != "ERR"
    state = initiator.check_xfer_state(handle)
expected = torch.zeros(size, dtype=torch.uint8)
for (l_addr, length, _), (r_addr, _, _) in zip([layout(dst)[i] for i in lidx], [layout(src)[i] for i in ridx]):
    lo, ro = l_addr - dst.data_ptr(), r_addr - src.data_ptr()
    expected[lo:lo + length] = src[ro:ro + length]
assert torch.equal(dst, expected), "the bytes did not land where vLLM asked"
print(initiator.get_xfer_telemetry(handle).descCount)
"""


def _posted_descriptors(merge: bool) -> int:
    out = subprocess.run([sys.executable, "-c", _AGENTS, "1" if merge else "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_real_agents_move_the_same_bytes_with_fewer_descriptors():
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    # 10 posted: NIXL itself joins some adjacent pairs of equal length (B with C, two attention
    # blocks); merged, each Mamba block is one descriptor and the attention pair at most two.
    unmerged, merged = _posted_descriptors(False), _posted_descriptors(True)
    assert merged <= 4 < unmerged <= 10
