"""Both legs' JSON bodies with the prompt encoded once: the same JSON as encoding each leg whole."""

from __future__ import annotations

import json

import pytest

from hybrid_pd.router.legs import LegEncoder, decode_body, prefill_body

KV = {"remote_block_ids": [[1, 2]], "remote_engine_id": "e1"}


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": list(range(512)), "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
        {"model": "m", "prompt": "héllo \u2028 \"quoted\"", "temperature": 0.5},
        {"model": "m", "messages": [{"role": "user", "content": "hi ☃"}], "max_completion_tokens": 4},
        {"prompt": [1]},
        {"model": "m"},
    ],
    ids=["token-ids", "text", "chat", "prompt-only", "no-prompt"],
)
def test_each_leg_is_the_json_of_its_body(body):
    encoder = LegEncoder(body)
    for leg in (prefill_body(body), decode_body(body, KV), decode_body(body, None)):
        encoded = encoder.encode(leg)
        assert json.loads(encoded) == leg
        assert encoded == json.dumps(json.loads(encoded), ensure_ascii=False, separators=(",", ":")).encode(), "not compact UTF-8"


def test_the_prompt_is_spliced_only_when_it_is_the_clients_own():
    body = {"model": "m", "prompt": [1, 2, 3]}
    encoder = LegEncoder(body)
    assert encoder.encode({"model": "m", "prompt": [1, 2, 3]}) == b'{"model":"m","prompt":[1,2,3]}'
    assert json.loads(encoder.encode({**body, "prompt": [9]}))["prompt"] == [9], "another prompt object is encoded as it is"
    assert json.loads(encoder.encode({"model": "m"})) == {"model": "m"}


def test_nan_and_infinity_are_refused_as_json_refuses_them():
    with pytest.raises(ValueError):
        LegEncoder({"prompt": "x"}).encode({"prompt": "x", "temperature": float("nan")})
    with pytest.raises(ValueError):
        LegEncoder({"prompt": [float("inf")]}).encode({"prompt": [float("inf")]})
