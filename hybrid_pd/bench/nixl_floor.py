"""The NIXL floor for the exact transfers vLLM posted: replay a trace with NIXL alone.

A worker started with ``--nixl-trace-dir DIR`` (both prefill and decode) records
every descriptor vLLM posts (``hybrid_pd/connector/vllm/nixl_trace.py``). This tool rebuilds the
same registered regions in two processes (a target that holds the state, an
initiator that pulls it, as vLLM's decode worker does), posts the same transfers
with the same descriptors, NIXL configuration and operation, and measures how long
they take when nothing else runs and completion is polled without pause:

- ``as-posted``: the traced descriptors;
- ``coalesced``: descriptors that are adjacent on both sides merged into one
  (what merging could do without moving any state);
- ``one-descriptor``: the same bytes per transfer as one contiguous descriptor
  (what fewer, larger descriptors could at best reach).

Each variant runs with 1 and with N transfers in flight (N posted together, as N
requests whose pulls start in the same engine step). Per transfer it reports the
wall time from post to DONE and NIXL's own ``xferDuration`` (the figure vLLM's
``vllm:nixl_xfer_time_seconds`` is built from). Completion is polled without pause,
or every ``--poll-interval-us`` (vLLM checks once per engine step).

    python -m hybrid_pd.bench.nixl_floor --trace DIR --in-flight 1,32 --json floor.json

UCX settings come from the environment, as in vLLM (set them before running);
``--target-device``/``--initiator-device`` put the two sides on other GPUs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hybrid_pd.connector.vllm.nixl_trace import Descriptor, Trace, load_trace

__all__ = ["FloorResult", "Replay", "measure_floor"]

NIXL_THREADS = 4  # vLLM's default num_threads for the UCX backend


@dataclass
class FloorResult:
    """Per-transfer figures of one variant at one number in flight."""

    variant: str
    in_flight: int
    transfers: int
    descriptors_per_transfer: float
    bytes_per_transfer: float
    wall_us_p50: float
    wall_us_p90: float
    nixl_xfer_us_p50: float
    nixl_xfer_us_p90: float
    nixl_post_us_p50: float  # NIXL's postDuration (vLLM: vllm:nixl_post_time_seconds)
    batch_us_p50: float  # post of the first to DONE of the last, per batch


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _coalesced(trace: Trace) -> tuple[tuple[Descriptor, ...], ...]:
    """Each transfer with runs of descriptors that are adjacent on both sides merged."""
    merged_transfers = []
    for transfer in trace.transfers:
        merged: list[Descriptor] = []
        for d in transfer:
            last = merged[-1] if merged else None
            if (
                last is not None
                and (last.local_region, last.remote_region) == (d.local_region, d.remote_region)
                and last.local_offset + last.length == d.local_offset
                and last.remote_offset + last.length == d.remote_offset
            ):
                merged[-1] = Descriptor(last.local_region, last.local_offset, last.remote_region, last.remote_offset, last.length + d.length)
            else:
                merged.append(d)
        merged_transfers.append(tuple(merged))
    return tuple(merged_transfers)


def _one_descriptor(trace: Trace) -> tuple[tuple[Descriptor, ...], ...]:
    """Each transfer's bytes as one descriptor, in an extra region after the traced ones on both sides."""
    local, remote = len(trace.local_region_bytes), len(trace.remote_region_bytes)
    return tuple((Descriptor(local, 0, remote, 0, sum(d.length for d in t)),) for t in trace.transfers)


_VARIANTS = {"as-posted": lambda trace: trace.transfers, "coalesced": _coalesced, "one-descriptor": _one_descriptor}
VARIANTS = tuple(_VARIANTS)


def _region_sizes(region_bytes: tuple[int, ...], trace: Trace) -> list[int]:
    """The traced regions' touched sizes, plus one region that holds a whole transfer as one descriptor."""
    return list(region_bytes) + [max(sum(d.length for d in t) for t in trace.transfers)]


def _allocate(mem_type: str, device: int, sizes: list[int]) -> tuple[list, list[tuple[int, int, int]]]:
    import torch

    where = "cpu" if mem_type == "DRAM" else f"cuda:{device}"
    buffers = [torch.ones(max(size, 1), dtype=torch.uint8, device=where) for size in sizes]
    dev = 0 if mem_type == "DRAM" else device
    return buffers, [(b.data_ptr(), b.numel(), dev) for b in buffers]


def _agent(name: str):  # noqa: ANN202 - NIXL's class
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(num_threads=NIXL_THREADS, capture_telemetry=True))


def _target(trace: Trace, device: int, conn) -> None:  # noqa: ANN001 - a multiprocessing connection
    """Hold the state to be pulled until the initiator is done."""
    buffers, regions = _allocate(trace.mem_type, device, _region_sizes(trace.remote_region_bytes, trace))
    agent = _agent("floor-target")
    agent.register_memory(agent.get_reg_descs([(*r, "") for r in regions], trace.mem_type))
    conn.send((agent.get_agent_metadata(), [r[0] for r in regions]))
    conn.recv()  # done
    del buffers


def _measure(agent, trace: Trace, transfers, local_base, remote_base, dev_l, dev_r, peer, in_flight, repeats, poll_s):  # noqa: ANN001, PLR0913
    flat_l, flat_r, ranges = [], [], []
    for t in transfers:
        start = len(flat_l)
        flat_l += [(local_base[d.local_region] + d.local_offset, d.length, dev_l) for d in t]
        flat_r += [(remote_base[d.remote_region] + d.remote_offset, d.length, dev_r) for d in t]
        ranges.append(list(range(start, len(flat_l))))
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(flat_l, trace.mem_type))
    remote = agent.prep_xfer_dlist(peer, agent.get_xfer_descs(flat_r, trace.mem_type))
    walls, nixl_us, post_us, batches = [], [], [], []
    warmup = 3
    for rep in range(warmup + repeats):
        picked = [(rep * in_flight + k) % len(transfers) for k in range(in_flight)]
        handles = [agent.make_prepped_xfer(trace.op, local, ranges[i], remote, ranges[i]) for i in picked]
        posted = []
        for h in handles:
            posted.append(time.perf_counter())
            if agent.transfer(h) == "ERR":
                raise RuntimeError("NIXL transfer failed to post")
        done = [0.0] * len(handles)
        pending = set(range(len(handles)))
        while pending:
            for k in list(pending):
                state = agent.check_xfer_state(handles[k])
                if state == "DONE":
                    done[k] = time.perf_counter()
                    pending.discard(k)
                elif state == "ERR":
                    raise RuntimeError("NIXL transfer failed")
            if pending and poll_s:
                time.sleep(poll_s)
        if rep >= warmup:
            walls += [(d - p) * 1e6 for d, p in zip(done, posted)]
            telemetry = [agent.get_xfer_telemetry(h) for h in handles]
            nixl_us += [t.xferDuration for t in telemetry]
            post_us += [t.postDuration for t in telemetry]
            batches.append((max(done) - posted[0]) * 1e6)
        for h in handles:
            agent.release_xfer_handle(h)
    return walls, nixl_us, post_us, batches


def _initiator(trace: Trace, device: int, target_device: int, plan: Replay, conn) -> None:  # noqa: ANN001
    meta, remote_base = conn.recv()
    buffers, regions = _allocate(trace.mem_type, device, _region_sizes(trace.local_region_bytes, trace))
    agent = _agent("floor-initiator")
    agent.register_memory(agent.get_reg_descs([(*r, "") for r in regions], trace.mem_type))
    peer = agent.add_remote_agent(meta)
    local_base = [r[0] for r in regions]
    dev_l = regions[0][2]
    dev_r = 0 if trace.mem_type == "DRAM" else target_device
    results = []
    for variant, build in _VARIANTS.items():
        transfers = build(trace)
        for k in plan.in_flight:
            walls, nixl_us, post_us, batches = _measure(
                agent, trace, transfers, local_base, remote_base, dev_l, dev_r, peer, k, plan.repeats, plan.poll_interval_us / 1e6
            )
            results.append(
                FloorResult(
                    variant=variant,
                    in_flight=k,
                    transfers=len(walls),
                    descriptors_per_transfer=statistics.fmean(len(t) for t in transfers),
                    bytes_per_transfer=statistics.fmean(sum(d.length for d in t) for t in transfers),
                    wall_us_p50=round(statistics.median(walls), 1),
                    wall_us_p90=round(_quantile(walls, 0.9), 1),
                    nixl_xfer_us_p50=round(statistics.median(nixl_us), 1),
                    nixl_xfer_us_p90=round(_quantile(nixl_us, 0.9), 1),
                    nixl_post_us_p50=round(statistics.median(post_us), 1),
                    batch_us_p50=round(statistics.median(batches), 1),
                )
            )
    conn.send([asdict(r) for r in results])
    del buffers


def _start(process: mp.Process, visible_device: int | None) -> None:
    """Start ``process``, seeing only ``visible_device`` when it is given (as a worker under CUDA_VISIBLE_DEVICES)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(visible_device)
    try:
        process.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


@dataclass(frozen=True)
class Replay:
    """How to replay a trace: transfers in flight per case, batches per case, completion polling."""

    in_flight: tuple[int, ...] = (1, 32)
    repeats: int = 50
    poll_interval_us: int = 0  # 0: poll without pause
    initiator_device: int = 0
    target_device: int = 0
    isolate_devices: bool = False  # each side sees only its own GPU, as workers pinned with CUDA_VISIBLE_DEVICES


def measure_floor(trace: Trace, plan: Replay) -> list[FloorResult]:
    """Replay ``trace`` in two fresh processes (NIXL reads its UCX settings from this environment)."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    c, d = ctx.Pipe()
    seen_target, seen_initiator = (0, 0) if plan.isolate_devices else (plan.target_device, plan.initiator_device)
    target = ctx.Process(target=_target, args=(trace, seen_target, a), daemon=True)
    initiator = ctx.Process(target=_initiator, args=(trace, seen_initiator, seen_target, plan, c), daemon=True)
    _start(target, plan.target_device if plan.isolate_devices else None)
    _start(initiator, plan.initiator_device if plan.isolate_devices else None)
    try:
        d.send(b.recv())  # the target's metadata and region addresses, to the initiator
        if not d.poll(600):
            raise TimeoutError("the initiator did not finish in 600 s")
        results = [FloorResult(**r) for r in d.recv()]
        b.send("done")
    finally:
        for proc in (initiator, target):
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return results


def _table(results: list[FloorResult]) -> str:
    rows = ["| variant | in flight | descriptors | bytes | wall p50 / p90 us | NIXL xfer p50 / p90 us | NIXL post p50 us | batch p50 us |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        rows.append(
            f"| {r.variant} | {r.in_flight} | {r.descriptors_per_transfer:.1f} | {r.bytes_per_transfer:,.0f} | "
            f"{r.wall_us_p50} / {r.wall_us_p90} | {r.nixl_xfer_us_p50} / {r.nixl_xfer_us_p90} | {r.nixl_post_us_p50} | "
            f"{r.batch_us_p50} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, required=True, help="a folder written by workers started with --nixl-trace-dir")
    ap.add_argument("--in-flight", default="1,32", help="transfers posted together, comma-separated")
    ap.add_argument("--repeats", type=int, default=50, help="measured batches per case (after 3 warm-up batches)")
    ap.add_argument("--initiator-device", type=int, default=0, help="GPU of the pulling side (VRAM traces)")
    ap.add_argument("--target-device", type=int, default=0, help="GPU of the side that holds the state")
    ap.add_argument("--poll-interval-us", type=int, default=0, help="check completion this often (default: without pause)")
    ap.add_argument("--isolate-devices", action="store_true", help="each side sees only its own GPU (CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    plan = Replay(
        in_flight=tuple(int(x) for x in args.in_flight.split(",")),
        repeats=args.repeats,
        poll_interval_us=args.poll_interval_us,
        initiator_device=args.initiator_device,
        target_device=args.target_device,
        isolate_devices=args.isolate_devices,
    )
    results = measure_floor(trace, plan)
    print(f"{len(trace.transfers)} traced {trace.op} transfers ({trace.mem_type}); "
          f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={os.environ.get('UCX_CUDA_IPC_ENABLE_GET_ZCOPY', '(unset)')}")  # fmt: skip
    print(_table(results))
    if args.json:
        env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        report = {"trace": str(args.trace), "traced_transfers": len(trace.transfers), "mem_type": trace.mem_type,
                  "replay": asdict(plan), "ucx_env": env, "results": [asdict(r) for r in results]}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
