"""``hybrid-pd size --emit-kustomize``: the picked layout as an overlay over deploy/k8s/gpu-pd (xPyD) or deploy/k8s/gpu
(flexible workers), rendered by ``kubectl kustomize`` (or, without a kubectl >= 1.21, read as YAML), with each worker's
command run through the CLI's parser."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from hybrid_pd.cli import build_parser, main
from hybrid_pd.sizing.kustomize import BASES, counts, write_overlay
from hybrid_pd.sizing.layouts import Layout
from hybrid_pd.sizing.simulate import Prediction
from tests.sizing_support import tiny_profile


def _prediction(kind: str, prefill: int, decode: int, prefill_tp: int = 1, decode_tp: int = 1) -> Prediction:
    layout = Layout(kind, prefill, decode, prefill_tp, decode_tp)  # type: ignore[arg-type]
    return Prediction(layout.name, kind, prefill, decode, layout.gpus, 100, 10.0, 10.0, 8.0, 8.0 / layout.gpus, 0.8, 100.0, 110.0, 9.0, 9.5,
                      prefill_tp, decode_tp)  # fmt: skip


def _kubectl_ok() -> bool:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return False
    out = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    minor = json.loads(out.stdout)["clientVersion"]["minor"] if out.returncode == 0 else ""
    return minor[:2].isdigit() and int(minor[:2]) >= 21


def rendered(directory: Path) -> dict[str, dict]:
    """The overlay's worker Deployments by name: as kubectl renders them, or (no kubectl >= 1.21) the base's
    (``<name>.yaml`` beside its kustomization) with the overlay's counts and patches applied by hand."""
    if _kubectl_ok():
        out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=True).stdout
        return {d["metadata"]["name"]: d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment" and d["metadata"]["name"] != "router"}
    overlay = yaml.safe_load((directory / "kustomization.yaml").read_text())
    (base,) = overlay["resources"]
    docs = {}
    for replicas in overlay["replicas"]:
        d = yaml.safe_load(((directory / base).resolve() / f"{replicas['name']}.yaml").read_text())
        d["spec"]["replicas"] = replicas["count"]
        docs[replicas["name"]] = d
    for patch in overlay.get("patches", []):
        for op in yaml.safe_load(patch["patch"]):  # JSON patch: "replace" a key, "add" to the end of a list ("-")
            *parents, last = [part.replace("~1", "/") for part in op["path"].split("/")[1:]]
            node = docs[patch["target"]["name"]]
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            if op["op"] == "add" and last == "-":
                node.append(op["value"])
            else:
                assert op["op"] == "replace" and last in node, op
                node[last] = op["value"]
    return docs


def _parses(container: dict) -> str:
    """The container's ``hybrid-pd`` command as the CLI parses it; returns the subcommand."""
    command = container["command"] + [a.replace("$(POD_IP)", "10.244.1.7") for a in container.get("args", [])]
    assert command[0] == "hybrid-pd"
    return build_parser().parse_args(command[1:]).command


def _replicas(deployments: dict[str, dict]) -> dict[str, int]:
    return {name: d["spec"]["replicas"] for name, d in deployments.items()}


def test_an_xpyd_layout_sets_the_prefill_and_decode_replicas_of_the_fixed_roles(tmp_path):
    write_overlay(_prediction("pd", 2, 6), None, tmp_path / "overlay", "a test")
    assert "gpu-pd" in (tmp_path / "overlay" / "kustomization.yaml").read_text()
    deployments = rendered(tmp_path / "overlay")
    assert _replicas(deployments) == {"prefill": 2, "decode": 6}
    assert [_parses(deployments[n]["spec"]["template"]["spec"]["containers"][0]) for n in ("prefill", "decode")] == ["prefill", "decode"]


@pytest.mark.parametrize("kind", ["flex", "replicas"])
def test_whole_request_layouts_scale_the_flexible_workers(tmp_path, kind):
    write_overlay(_prediction(kind, 0, 16), None, tmp_path / "overlay", "a test")
    deployments = rendered(tmp_path / "overlay")
    assert _replicas(deployments) == {"flex": 16}, "no prefill or decode pod"
    assert _parses(deployments["flex"]["spec"]["template"]["spec"]["containers"][0]) == "flex"
    assert counts(_prediction(kind, 0, 16)) == {"prefill": 0, "decode": 0, "flex": 16}


def test_another_base_is_named_as_given(tmp_path):
    """--k8s-base: e.g. gpu-rdma, an overlay of gpu, for flexible workers on RDMA."""
    write_overlay(_prediction("flex", 0, 4), BASES["flex"].parent / "gpu-rdma", tmp_path / "overlay", "a test")
    assert "/gpu-rdma\n" in (tmp_path / "overlay" / "kustomization.yaml").read_text()
    if _kubectl_ok():  # the hand-made rendering reads a base's own files, not an overlay's
        deployments = rendered(tmp_path / "overlay")
        assert _replicas(deployments) == {"flex": 4} and deployments["flex"]["spec"]["template"]["spec"]["hostNetwork"] is True


def _tp(deployment: dict) -> tuple[int, str]:
    """(the worker's tensor-parallel size as its CLI parses it, the GPUs its pod asks for)."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    command = container["command"] + [a.replace("$(POD_IP)", "10.244.1.7") for a in container["args"]]
    return build_parser().parse_args(command[1:]).tensor_parallel_size, container["resources"]["limits"]["nvidia.com/gpu"]


def test_workers_of_several_gpus_ask_for_them_and_run_tensor_parallel(tmp_path):
    write_overlay(_prediction("pd", 1, 2, prefill_tp=2, decode_tp=1), None, tmp_path / "pd", "a test")
    deployments = rendered(tmp_path / "pd")
    assert (_tp(deployments["prefill"]), _tp(deployments["decode"])) == ((2, "2"), (1, "1"))
    assert (deployments["prefill"]["spec"]["replicas"], deployments["decode"]["spec"]["replicas"]) == (1, 2)
    write_overlay(_prediction("flex", 0, 3, decode_tp=4), None, tmp_path / "flex", "a test")
    deployments = rendered(tmp_path / "flex")
    assert _tp(deployments["flex"]) == (4, "4") and _replicas(deployments) == {"flex": 3}
    assert "1P(TP2)2D(TP1) on 4 GPUs" in (tmp_path / "pd" / "kustomization.yaml").read_text()


def test_size_writes_the_overlay_of_the_best_layout(tmp_path, capsys):
    tiny_profile().save(tmp_path / "profile.json")
    argv = ["size", "--profile", str(tmp_path / "profile.json"), "--gpus", "3", "--input-len", "300", "--output-len", "20",
            "--concurrency", "8", "--slo-ttft-ms", "100", "--slo-tpot-ms", "8", "--json", str(tmp_path / "size.json")]  # fmt: skip
    assert main([*argv, "--emit-kustomize", str(tmp_path / "k8s")]) == 0
    picked = json.loads((tmp_path / "size.json").read_text())["best"]["3"]
    (p,) = [p for p in json.loads((tmp_path / "size.json").read_text())["predictions"] if p["layout"] == picked]
    deployments = rendered(tmp_path / "k8s")
    want = {"prefill": p["prefill"], "decode": p["decode"]} if p["kind"] == "pd" else {"flex": p["decode"]}
    assert _replicas(deployments) == want
    assert f"wrote {tmp_path / 'k8s' / 'kustomization.yaml'}" in capsys.readouterr().out


def test_an_overlay_is_of_one_gpu_count_and_a_real_base(tmp_path, capsys):
    tiny_profile().save(tmp_path / "profile.json")
    argv = ["size", "--profile", str(tmp_path / "profile.json"), "--input-len", "300", "--output-len", "20", "--concurrency", "8",
            "--slo-ttft-ms", "100", "--slo-tpot-ms", "8", "--emit-kustomize", str(tmp_path / "k8s")]  # fmt: skip
    assert main([*argv, "--gpus", "2,3"]) == 2
    assert "--emit-kustomize: give one GPU count" in capsys.readouterr().err
    assert main([*argv, "--gpus", "2", "--k8s-base", str(tmp_path)]) == 2
    assert "--k8s-base" in capsys.readouterr().err and not (tmp_path / "k8s" / "kustomization.yaml").exists()
