"""A layout ``hybrid-pd size`` picked, as a kustomize overlay over deploy/k8s (``hybrid-pd size --emit-kustomize DIR``).

Each variant runs its workers as Deployments, one GPU a pod, each pod registering itself with the
routers; a layout is their replica counts:

- ``xPyD``: over deploy/k8s/gpu-pd (fixed roles), ``prefill`` x replicas, ``decode`` y;
- ``N flex`` and ``N replicas``: over deploy/k8s/gpu, ``flex`` N replicas (``hybrid-pd flex``, vLLM's
  ``kv_both``: each serves whole requests, or prefills or decodes for another as the routers'
  planner says). The manifests ship no plain vLLM replica; flexible workers without a planner
  profile serve as replicas (the simulator runs them so, as they measured on two H100s).

The overlay is one ``kustomization.yaml`` that names the base by a relative path, sets the counts
(kustomize's ``replicas:``) and, for workers of more than one GPU (tensor parallelism), patches the
GPUs each pod asks for and adds a ``--tensor-parallel-size`` after the base's (the worker's parser
keeps the last). Another base (``--k8s-base``) must hold the Deployments the layout scales.
"""

from __future__ import annotations

import os
from pathlib import Path

from hybrid_pd.sizing.simulate import Prediction

__all__ = ["BASES", "counts", "overlay", "write_overlay"]

_K8S = Path(__file__).resolve().parent.parent.parent / "deploy" / "k8s"
# The variant each kind of layout deploys over: fixed roles, or flexible workers.
BASES = {"pd": _K8S / "gpu-pd", "flex": _K8S / "gpu", "replicas": _K8S / "gpu"}

_CONTAINER = "/spec/template/spec/containers/0"


def _tp_ops(tp: int) -> list[str]:
    return [f"{{op: add, path: {_CONTAINER}/args/-, value: --tensor-parallel-size={tp}}}",
            f'{{op: replace, path: {_CONTAINER}/resources/limits/nvidia.com~1gpu, value: "{tp}"}}']  # fmt: skip


def counts(prediction: Prediction) -> dict[str, int]:
    """Replicas of each worker Deployment for a layout: ``prefill``, ``decode`` and ``flex``."""
    if prediction.kind == "pd":
        return {"prefill": prediction.prefill, "decode": prediction.decode, "flex": 0}
    return {"prefill": 0, "decode": 0, "flex": prediction.decode}


def overlay(prediction: Prediction, base: Path, directory: Path, why: str) -> str:
    """The ``kustomization.yaml`` of ``directory`` that deploys ``prediction``'s layout over ``base``; ``why``: its first comment."""
    scaled = {name: n for name, n in counts(prediction).items() if n}
    lines = [
        f"# {prediction.layout} on {prediction.gpus} GPUs, picked by hybrid-pd size: {why}",
        f"# predicted goodput {prediction.goodput_per_gpu:.2f} req/s per GPU ({prediction.slo_met:.0%} within the SLOs), "
        f"{prediction.throughput_rps:.2f} req/s. kubectl apply -k {directory}",
    ]
    if "flex" in scaled:
        lines.append("# Flexible workers (hybrid-pd flex): whole requests, or the roles the routers' planner gives them.")
    lines += [
        "apiVersion: kustomize.config.k8s.io/v1beta1",
        "kind: Kustomization",
        "resources:",
        f"  - {os.path.relpath(base.resolve(), directory.resolve())}",
        "replicas:",
        *(f"  - {{name: {name}, count: {n}}}" for name, n in scaled.items()),
    ]
    tp = {"prefill": prediction.prefill_tp, "decode": prediction.decode_tp, "flex": prediction.decode_tp}
    patched = [name for name in scaled if tp[name] != 1]
    if patched:
        lines.append("patches:")
    for name in patched:
        lines += [f"  - target: {{kind: Deployment, name: {name}}}", "    patch: |-", *(f"      - {op}" for op in _tp_ops(tp[name]))]
    return "\n".join(lines) + "\n"


def write_overlay(prediction: Prediction, base: Path | None, directory: Path, why: str) -> Path:
    """Write the overlay over ``base`` (None: the variant of the layout's kind, :data:`BASES`); returns its ``kustomization.yaml``."""
    base = BASES[prediction.kind] if base is None else base
    if not (base / "kustomization.yaml").is_file():
        raise ValueError(f"{base} holds no kustomization.yaml: give the deploy/k8s variant to overlay")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "kustomization.yaml"
    path.write_text(overlay(prediction, base, directory, why))
    return path
