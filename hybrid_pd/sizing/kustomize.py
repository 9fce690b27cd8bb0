"""A layout ``hybrid-pd size`` picked, as a kustomize overlay over deploy/k8s (``hybrid-pd size --emit-kustomize DIR``).

deploy/k8s/gpu runs a ``prefill`` and a ``decode`` Deployment, one GPU a pod, each pod registering
itself with the router; a layout is their replica counts:

- ``xPyD``: ``prefill`` x replicas, ``decode`` y;
- ``N flex`` and ``N replicas``: ``decode`` N replicas running ``hybrid-pd flex`` (vLLM's
  ``kv_both``: it serves whole requests, and prefills or decodes for another when the router
  splits by phase), ``prefill`` none. The manifests ship no plain vLLM replica; flexible workers
  serve as replicas (the simulator runs them so, as they measured on two H100s).

The overlay is one ``kustomization.yaml`` that names the base by a relative path, sets the counts
(kustomize's ``replicas:``) and patches the containers: for flexible workers the decode
container's role; for workers of more than one GPU (tensor parallelism) the GPUs the pod asks for
and a ``--tensor-parallel-size`` after the base's (the worker's parser keeps the last).
"""

from __future__ import annotations

import os
from pathlib import Path

from hybrid_pd.sizing.simulate import Prediction

__all__ = ["DEFAULT_BASE", "counts", "overlay", "write_overlay"]

DEFAULT_BASE = Path(__file__).resolve().parent.parent.parent / "deploy" / "k8s" / "gpu"

_CONTAINER = "/spec/template/spec/containers/0"
_FLEX_OP = f"{{op: replace, path: {_CONTAINER}/command, value: [hybrid-pd, flex]}}"


def _tp_ops(tp: int) -> list[str]:
    return [f"{{op: add, path: {_CONTAINER}/args/-, value: --tensor-parallel-size={tp}}}",
            f'{{op: replace, path: {_CONTAINER}/resources/limits/nvidia.com~1gpu, value: "{tp}"}}']  # fmt: skip


def counts(prediction: Prediction) -> dict[str, int]:
    """Replicas of each Deployment for a layout: ``prefill``, ``decode`` and ``flex`` (flex workers run as the decode Deployment)."""
    if prediction.kind == "pd":
        return {"prefill": prediction.prefill, "decode": prediction.decode, "flex": 0}
    return {"prefill": 0, "decode": 0, "flex": prediction.decode}


def overlay(prediction: Prediction, base: Path, directory: Path, why: str) -> str:
    """The ``kustomization.yaml`` of ``directory`` that deploys ``prediction``'s layout over ``base``; ``why``: its first comment."""
    n = counts(prediction)
    flex = n["flex"] > 0
    lines = [
        f"# {prediction.layout} on {prediction.gpus} GPUs, picked by hybrid-pd size: {why}",
        f"# predicted goodput {prediction.goodput_per_gpu:.2f} req/s per GPU ({prediction.slo_met:.0%} within the SLOs), "
        f"{prediction.throughput_rps:.2f} req/s. kubectl apply -k {directory}",
    ]
    if flex:
        lines.append("# Flexible workers (hybrid-pd flex) run as the decode Deployment; no prefill pod.")
    lines += [
        "apiVersion: kustomize.config.k8s.io/v1beta1",
        "kind: Kustomization",
        "resources:",
        f"  - {os.path.relpath(base.resolve(), directory.resolve())}",
        "replicas:",
        f"  - {{name: prefill, count: {n['prefill']}}}",
        f"  - {{name: decode, count: {n['flex'] if flex else n['decode']}}}",
    ]
    ops = {"prefill": _tp_ops(prediction.prefill_tp) if n["prefill"] and prediction.prefill_tp != 1 else [],
           "decode": ([_FLEX_OP] if flex else []) + (_tp_ops(prediction.decode_tp) if prediction.decode_tp != 1 else [])}  # fmt: skip
    if any(ops.values()):
        lines.append("patches:")
    for name, patch in ops.items():
        if patch:
            lines += [f"  - target: {{kind: Deployment, name: {name}}}", "    patch: |-", *(f"      - {op}" for op in patch)]
    return "\n".join(lines) + "\n"


def write_overlay(prediction: Prediction, base: Path, directory: Path, why: str) -> Path:
    """Write the overlay; returns its ``kustomization.yaml``."""
    if not (base / "kustomization.yaml").is_file():
        raise ValueError(f"{base} holds no kustomization.yaml: give the deploy/k8s variant to overlay")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "kustomization.yaml"
    path.write_text(overlay(prediction, base, directory, why))
    return path
