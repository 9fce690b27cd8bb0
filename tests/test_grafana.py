"""deploy/grafana/hybrid-pd-router.json asks Prometheus only for names the router exports, and shows every one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "hybrid-pd-router.json"
_NAME = re.compile(r"\bhybrid_pd_[a-z0-9_]+\b")


def _queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


async def test_every_name_the_dashboard_queries_is_one_a_fresh_router_exports(client):
    """Scraped before any request: a panel must not wait for traffic to find its series."""
    exported = {f.name: {s.name for s in f.samples} for f in text_string_to_metric_families((await client.get("/metrics")).text)}
    samples = set().union(*exported.values())
    used = {name for query in _queries() for name in _NAME.findall(query)}
    assert used and used <= samples, f"not exported: {sorted(used - samples)}"
    # prometheus_client's ``*_created`` timestamps parse as families of their own; nobody graphs them
    families = {family for family in exported if family.startswith("hybrid_pd_") and not family.endswith("_created")}
    assert {family for family in families if exported[family] & used} == families, "a router metric has no panel"


def test_panels_have_unique_ids_and_each_query_a_ref():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
