"""What a worker reports to the router is what its vLLM runs: computed from the spec by the launch rules."""

from __future__ import annotations

import pytest

from hybrid_pd.connector.compat import NO_SPECULATION, check_worker
from hybrid_pd.connector.identity import worker_identity
from hybrid_pd.connector.launch import WorkerSpec, build_launch


def _spec(role="decode", **kw):
    return WorkerSpec(role=role, model="/models/m", port=8100, side_channel_port=5600, **kw)


@pytest.mark.parametrize(
    ("kw", "dtype"), [({}, "float32"), ({"device": "cuda"}, "auto"), ({"dtype": "bfloat16"}, "bfloat16")]
)
def test_dtype_and_layout_are_the_ones_vllm_is_started_with(kw, dtype):
    spec = _spec(**kw)
    identity = worker_identity(spec, block_size=128)
    launch = build_launch(spec)
    assert identity.dtype == launch.argv[launch.argv.index("--dtype") + 1] == dtype
    assert identity.conv_state_layout == launch.env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
    check_worker(identity)


def test_identity_names_the_served_model_and_the_parallelism():
    identity = worker_identity(_spec("prefill", served_model_name="tiny", tensor_parallel_size=2), block_size=None)
    assert (identity.role, identity.model, identity.block_size) == ("prefill", "tiny", None)
    assert (identity.tensor_parallel_size, identity.pipeline_parallel_size) == (2, 1)
    assert worker_identity(_spec(), block_size=16).model == "/models/m"


def test_the_speculative_config_reported_is_the_one_vllm_is_started_with():
    mtp = '{"method":"mtp","num_speculative_tokens":2}'
    launch = build_launch(_spec(speculative_config=mtp))
    assert worker_identity(_spec(speculative_config=mtp), block_size=None).speculative_config == mtp
    assert launch.argv[launch.argv.index("--speculative-config") + 1] == mtp
    assert worker_identity(_spec(), block_size=None).speculative_config == NO_SPECULATION
    assert "--speculative-config" not in build_launch(_spec()).argv
