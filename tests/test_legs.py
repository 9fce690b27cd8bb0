"""The request rewriting of both legs (the usage merge: tests/test_router_relay.py)."""

from hybrid_pd.connector.trace.timeline import REQUEST_ID_PARAM
from hybrid_pd.router.legs import PREFILL_KV_TRANSFER_PARAMS, decode_body, prefill_body


def test_prefill_leg_is_one_token_not_streamed_and_asks_for_remote_decode():
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 4,
        "temperature": 0,
    }
    out = prefill_body(body)
    assert out["max_tokens"] == 1
    assert out["stream"] is False
    assert "stream_options" not in out and "min_tokens" not in out
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert out["temperature"] == 0 and out["prompt"] == "hi"
    assert body["max_tokens"] == 64 and body["stream"] is True, "the client's request is not modified"


def test_prefill_leg_caps_max_completion_tokens_only_when_set():
    assert "max_completion_tokens" not in prefill_body({"messages": []})
    assert prefill_body({"messages": [], "max_completion_tokens": 50})["max_completion_tokens"] == 1


def test_prefill_params_are_a_fresh_copy_per_request():
    prefill_body({})["kv_transfer_params"]["remote_host"] = "x"
    assert PREFILL_KV_TRANSFER_PARAMS["remote_host"] is None


def test_decode_leg_is_the_client_request_plus_the_prefill_params_unchanged():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "stream": True}
    params = {"do_remote_prefill": True, "remote_block_ids": [[1], [2]], "remote_engine_id": "e", "tp_size": 1}
    out = decode_body(body, params)
    assert out == {**body, "kv_transfer_params": params}
    assert out["kv_transfer_params"] is params


def test_decode_leg_without_params_is_the_client_request():
    body = {"model": "m", "prompt": "x"}
    assert decode_body(body, None) == body



def test_both_legs_carry_the_routers_request_id_for_the_engines_timeline():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8}
    params = {"do_remote_prefill": True, "remote_block_ids": [[1]]}
    assert prefill_body(body, "r-1")["kv_transfer_params"][REQUEST_ID_PARAM] == "r-1"
    assert REQUEST_ID_PARAM not in PREFILL_KV_TRANSFER_PARAMS  # the shared template stays as it was
    decode = decode_body(body, params, "r-1")["kv_transfer_params"]
    assert decode == {**params, REQUEST_ID_PARAM: "r-1"} and REQUEST_ID_PARAM not in params
    assert decode_body(body, None, "r-1") == body  # no state to pull: nothing for the engine to trace
