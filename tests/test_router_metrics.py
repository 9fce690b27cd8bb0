"""The router's metrics tell the truth: every known series from the start, each route under its own name, every leg timed."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from hybrid_pd.router.decider import LOCAL_REASONS, SPLIT_REASONS
from hybrid_pd.router.metrics import GENERATION, MIGRATION_OUTCOMES, OUTCOMES, REFUSALS, ROUTES
from hybrid_pd.router.policies import PREFIX_OUTCOMES
from tests.router_support import DECODE, PREFILL

ROUTER = Path(__file__).resolve().parents[1] / "hybrid_pd" / "router"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _value(text: str, name: str, **labels: str) -> float | None:
    return _samples(text).get((name, tuple(sorted(labels.items()))))


async def test_every_counter_has_its_known_series_at_zero_before_any_request(client):
    text = (await client.get("/metrics")).text
    for route in ROUTES:
        assert _value(text, "hybrid_pd_requests_total", route=route, outcome="ok") == 0, route
    for route in GENERATION:
        for outcome in OUTCOMES:
            assert _value(text, "hybrid_pd_requests_total", route=route, outcome=outcome) == 0, (route, outcome)
    for reason in LOCAL_REASONS:
        assert _value(text, "hybrid_pd_fallbacks_total", reason=reason) == 0, reason
    for reason in SPLIT_REASONS:
        assert _value(text, "hybrid_pd_disaggregated_total", reason=reason) == 0, reason
    for status in REFUSALS:
        assert _value(text, "hybrid_pd_rejected_total", status=str(status)) == 0, status
    for outcome in MIGRATION_OUTCOMES:
        assert _value(text, "hybrid_pd_migrations_total", outcome=outcome) == 0, outcome
    assert _value(text, "hybrid_pd_retries_total") == 0
    for role in ("prefill", "decode"):
        assert _value(text, "hybrid_pd_prefix_reusable_tokens_total", role=role) == 0, role
        for outcome in PREFIX_OUTCOMES:
            assert _value(text, "hybrid_pd_prefix_routes_total", role=role, outcome=outcome) == 0, (role, outcome)
    for role, url in (("prefill", PREFILL), ("decode", DECODE)):
        assert _value(text, "hybrid_pd_worker_inflight", role=role, url=url) == 0, role


def _source() -> str:
    return "\n".join(p.read_text() for p in sorted(ROUTER.glob("*.py")))


def test_the_known_labels_are_every_label_the_code_gives():
    """What the code counts under a literal label is declared: its series exist from the start."""
    source = _source()
    statuses = {int(s) for s in re.findall(r"OpenAIError\((\d{3})", source)}
    assert statuses - {499} == set(REFUSALS)  # 499: nobody reads it; the request counts as client_disconnected
    decider = (ROUTER / "decider.py").read_text()
    reasons = set(re.findall(r"Decision\(\(\), \"(\w+)\"\)", decider)) | set(re.findall(r"reason = \"(\w+)\"", source))
    assert reasons and reasons <= set(LOCAL_REASONS) | set(SPLIT_REASONS)
    assert set(LOCAL_REASONS).isdisjoint(SPLIT_REASONS)
    assert set(re.findall(r"on_migrated\(\"(\w+)\"\)", source)) == set(MIGRATION_OUTCOMES)


async def test_chat_requests_are_counted_as_chat(client):
    r = await client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    text = (await client.get("/metrics")).text
    assert _value(text, "hybrid_pd_requests_total", route="chat", outcome="ok") == 1
    assert _value(text, "hybrid_pd_requests_total", route="completions", outcome="ok") == 0


async def test_a_whole_answer_times_its_decode_leg_and_end_to_end_but_no_first_token(client):
    assert (await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})).status_code == 200
    text = (await client.get("/metrics")).text
    assert _value(text, "hybrid_pd_decode_leg_seconds_count") == 1
    assert _value(text, "hybrid_pd_e2e_seconds_count") == 1
    assert _value(text, "hybrid_pd_ttft_seconds_count") == 0  # streamed only: a whole answer's first byte is its last


async def test_a_stream_times_its_first_token_decode_leg_and_end_to_end(client, workers):
    workers.decode_stream = [b'data: {"choices":[{"index":0,"text":" a"}]}\n\n', b"data: [DONE]\n\n"]
    assert (await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})).status_code == 200
    text = (await client.get("/metrics")).text
    for name in ("hybrid_pd_ttft_seconds_count", "hybrid_pd_decode_leg_seconds_count", "hybrid_pd_e2e_seconds_count"):
        assert _value(text, name) == 1, name


async def test_every_choice_of_a_whole_answer_times_its_own_decode_leg(client):
    r = await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "max_tokens": 2})
    assert r.status_code == 200
    assert _value((await client.get("/metrics")).text, "hybrid_pd_decode_leg_seconds_count") == 2


async def test_a_workers_refusal_times_no_decode_leg(client, workers):
    workers.prefill_response = httpx.Response(400, json={"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}})
    r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 400
    text = (await client.get("/metrics")).text
    assert _value(text, "hybrid_pd_requests_total", route="completions", outcome="http_400") == 1
    assert _value(text, "hybrid_pd_decode_leg_seconds_count") == 0
