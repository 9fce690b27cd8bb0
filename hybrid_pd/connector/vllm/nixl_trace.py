"""Record the NIXL transfers a vLLM worker posts, so a benchmark can replay them exactly.

The floor of a state transfer depends on what is posted: how many descriptors, of
which sizes, in how many registered regions. Rather than re-deriving vLLM's
descriptor rules (they change between versions), a worker started with
``HYBRID_PD_NIXL_TRACE_DIR`` records them at the NIXL API, below vLLM: every
memory registration (regions and memory type), every prepared descriptor list,
and for every transfer request the (address, length) of each local and remote
descriptor. ``hybrid_pd/bench/nixl_floor.py`` replays a trace with NIXL alone.

One JSON object per line, in ``<dir>/nixl-<pid>.jsonl``:

- ``{"event": "agent", "name": ...}`` when an agent is created;
- ``{"event": "register", "agent": ..., "mem_type": "VRAM", "regions": [[addr, len, dev], ...]}``;
- ``{"event": "xfer", "agent": ..., "op": "READ", "remote_agent": ..., "local": [[addr, len], ...],
  "remote": [[addr, len], ...]}`` for each ``make_prepped_xfer``.

Only lists given as ``(addr, len, dev[, meta])`` tuples or Nx3 arrays are traced,
which is how vLLM's NIXL connector builds them; recording costs a few microseconds
per descriptor.
:func:`load_trace` reads a trace folder back as offsets into the registered regions.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Descriptor", "Trace", "descriptor_tuples", "load_trace", "record_transfers"]


log = logging.getLogger("hybrid_pd.nixl_trace")


class _Recorder:
    """Remembers the tuples behind NIXL's opaque lists and handles, and writes events."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._out = open(directory / f"nixl-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the process
        self._lock = threading.Lock()
        # id(NIXL object) -> (the object, kept alive so the id stays unique; its tuples; its memory type or agent)
        self.lists: dict[int, tuple[Any, list, str | None]] = {}
        self.prepped: dict[int, tuple[Any, list, str]] = {}
        self.failed = False

    def write(self, event: dict) -> None:
        """Append ``event``; a trace that cannot be written is lost, the transfer never is."""
        try:
            line = json.dumps(event, separators=(",", ":"), default=_name)
            with self._lock:
                self._out.write(line + "\n")
        except (TypeError, ValueError, OSError) as exc:
            self.lost(exc)

    def lost(self, exc: Exception) -> None:
        if not self.failed:
            log.warning("NIXL trace: cannot record an event (%s); later failures are not logged", exc)
        self.failed = True


def _name(value: Any) -> str:
    """Agent names reach NIXL as str or bytes; the trace stores str."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    raise TypeError(f"cannot trace a {type(value).__name__}")


def descriptor_tuples(descs: Any) -> list | None:
    """``[[addr, len, dev], ...]`` of a list of tuples or an Nx3 array (vLLM builds both); None otherwise."""
    if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
        return [[int(x) for x in d[:3]] for d in descs]
    shape = getattr(descs, "shape", None)
    if shape is not None and len(shape) == 2 and shape[1] in (3, 4):
        return [[int(x) for x in row[:3]] for row in descs.tolist()]
    return None


def record_transfers(directory: str | Path) -> type:
    """Trace every NIXL agent created from now on in this process into ``directory``.

    Returns the agent class that was patched (vLLM's ``NixlWrapper``).
    """
    from vllm.distributed.nixl_utils import NixlWrapper  # the NIXL flavour vLLM picked (cu12, cu13, rocm)

    if NixlWrapper is None:
        raise RuntimeError("NIXL is not importable in this process")
    if getattr(NixlWrapper, "_hybrid_pd_traced", False):
        return NixlWrapper
    rec = _Recorder(Path(directory))
    cls = NixlWrapper
    orig = {name: getattr(cls, name) for name in
            ("__init__", "get_reg_descs", "register_memory", "get_xfer_descs", "prep_xfer_dlist", "make_prepped_xfer")}  # fmt: skip

    def __init__(self, agent_name: str, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - patched method
        orig["__init__"](self, agent_name, *args, **kwargs)
        self._hybrid_pd_name = agent_name
        rec.write({"event": "agent", "name": agent_name, "pid": os.getpid()})

    def get_reg_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        out = orig["get_reg_descs"](self, descs, mem_type)
        if (tuples := descriptor_tuples(descs)) is not None:
            rec.lists[id(out)] = (out, tuples, mem_type)
        return out

    def register_memory(self, reg_list: Any, mem_type: str | None = None, backends: list[str] = []) -> Any:  # noqa: B006 - NIXL's signature
        out = orig["register_memory"](self, reg_list, mem_type, backends)
        known = rec.lists.get(id(reg_list))
        tuples, kind = (known[1], known[2]) if known else (descriptor_tuples(reg_list), mem_type)
        if tuples is not None:
            rec.write({"event": "register", "agent": getattr(self, "_hybrid_pd_name", None), "mem_type": kind, "regions": tuples})
        return out

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        out = orig["get_xfer_descs"](self, descs, mem_type)
        if (tuples := descriptor_tuples(descs)) is not None:
            rec.lists[id(out)] = (out, tuples, mem_type)
        return out

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, *args: Any, **kwargs: Any) -> Any:
        handle = orig["prep_xfer_dlist"](self, agent_name, xfer_list, *args, **kwargs)
        known = rec.lists.get(id(xfer_list))
        tuples = known[1] if known else descriptor_tuples(xfer_list)
        if tuples is not None:
            rec.prepped[id(handle)] = (handle, tuples, agent_name)
        return handle

    def make_prepped_xfer(self, operation: str, local: Any, local_indices: Any, remote: Any, remote_indices: Any, *args: Any, **kwargs: Any) -> Any:
        handle = orig["make_prepped_xfer"](self, operation, local, local_indices, remote, remote_indices, *args, **kwargs)
        mine, theirs = rec.prepped.get(id(local)), rec.prepped.get(id(remote))
        if mine is None or theirs is None:
            return handle
        try:
            local_descs = [mine[1][int(i)][:2] for i in local_indices]
            remote_descs = [theirs[1][int(i)][:2] for i in remote_indices]
        except (IndexError, TypeError, ValueError) as exc:
            rec.lost(exc)
            return handle
        rec.write({"event": "xfer", "agent": getattr(self, "_hybrid_pd_name", None), "op": operation,
                   "remote_agent": theirs[2], "local": local_descs, "remote": remote_descs})  # fmt: skip
        return handle

    for name, fn in (("__init__", __init__), ("get_reg_descs", get_reg_descs), ("register_memory", register_memory),
                     ("get_xfer_descs", get_xfer_descs), ("prep_xfer_dlist", prep_xfer_dlist),
                     ("make_prepped_xfer", make_prepped_xfer)):  # fmt: skip
        setattr(cls, name, fn)
    cls._hybrid_pd_traced = True
    return cls


@dataclass(frozen=True)
class Descriptor:
    """One posted descriptor, as (region index, offset) on both sides and its length."""

    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    length: int


@dataclass(frozen=True)
class Trace:
    """The transfers one agent posted to one peer, relative to the regions both registered."""

    mem_type: str
    op: str
    local_region_bytes: tuple[int, ...]  # how much of each registered region the transfers touch
    remote_region_bytes: tuple[int, ...]
    transfers: tuple[tuple[Descriptor, ...], ...]


def _locate(regions: list[tuple[int, int]], addr: int, length: int) -> tuple[int, int]:
    starts = [start for start, _ in regions]
    i = bisect.bisect_right(starts, addr) - 1
    if i < 0 or addr + length > regions[i][0] + regions[i][1]:
        raise ValueError(f"descriptor at {addr:#x} (+{length}) is in no registered region")
    return i, addr - regions[i][0]


def load_trace(directory: str | Path) -> Trace:
    """Read a trace folder: the busiest initiator's transfers to its busiest peer.

    Needs the registrations of both agents, so trace both workers (prefill and decode).
    """
    events = [json.loads(line) for path in sorted(Path(directory).glob("nixl-*.jsonl")) for line in path.read_text().splitlines() if line]
    xfers = [e for e in events if e["event"] == "xfer"]
    if not xfers:
        raise ValueError(f"no transfers in {directory}")
    initiator = Counter(e["agent"] for e in xfers).most_common(1)[0][0]
    peer = Counter(e["remote_agent"] for e in xfers if e["agent"] == initiator).most_common(1)[0][0]
    mine = [e for e in xfers if e["agent"] == initiator and e["remote_agent"] == peer]
    regions: dict[str, list[tuple[int, int]]] = {}
    mem_types = set()
    for e in events:
        if e["event"] == "register" and e["agent"] in (initiator, peer):
            regions.setdefault(e["agent"], []).extend((addr, length) for addr, length, _dev in e["regions"])
            mem_types.add(e["mem_type"])
    for agent in (initiator, peer):
        if agent not in regions:
            raise ValueError(f"no memory registration of agent {agent} in {directory}: trace both workers")
        regions[agent] = sorted(set(regions[agent]))
    transfers = []
    touched = {agent: [0] * len(regions[agent]) for agent in (initiator, peer)}
    for e in mine:
        descs = []
        for (la, ll), (ra, rl) in zip(e["local"], e["remote"], strict=True):
            if ll != rl:
                raise ValueError(f"local and remote descriptor lengths differ ({ll} != {rl})")
            (li, lo), (ri, ro) = _locate(regions[initiator], la, ll), _locate(regions[peer], ra, rl)
            touched[initiator][li] = max(touched[initiator][li], lo + ll)
            touched[peer][ri] = max(touched[peer][ri], ro + rl)
            descs.append(Descriptor(li, lo, ri, ro, ll))
        transfers.append(tuple(descs))
    if len(mem_types) != 1:
        raise ValueError(f"expected one memory type in {directory}, found {sorted(mem_types)}")
    return Trace(
        mem_type=mem_types.pop(),
        op=mine[0]["op"],
        local_region_bytes=tuple(touched[initiator]),
        remote_region_bytes=tuple(touched[peer]),
        transfers=tuple(transfers),
    )
