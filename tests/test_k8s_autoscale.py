"""deploy/k8s/autoscale/keda.yaml scales the gpu-pd variant's Deployments on names a fresh router exports."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
_NAME = re.compile(r"\bhybrid_pd_[a-z0-9_]+\b")


def _scaled_objects() -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "autoscale" / "keda.yaml").read_text()) if d]


def _deployments(variant: str) -> set[str]:
    names = set()
    for path in (DEPLOY / variant).glob("*.yaml"):
        names |= {d["metadata"]["name"] for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "Deployment"}
    return names


async def test_every_query_names_series_a_fresh_router_exports(client):
    samples = {s.name for f in text_string_to_metric_families((await client.get("/metrics")).text) for s in f.samples}
    queries = [t["metadata"]["query"] for so in _scaled_objects() for t in so["spec"]["triggers"]]
    used = {name for q in queries for name in _NAME.findall(q)}
    assert used and used <= samples, f"not exported: {sorted(used - samples)}"


def test_each_pool_scales_its_own_deployment_with_numeric_thresholds():
    objects = _scaled_objects()
    assert {so["kind"] for so in objects} == {"ScaledObject"}
    assert {so["spec"]["scaleTargetRef"]["name"] for so in objects} == {"prefill", "decode"} <= _deployments("gpu-pd")
    for so in objects:
        assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
        for trigger in so["spec"]["triggers"]:
            assert float(trigger["metadata"]["threshold"]) > 0
