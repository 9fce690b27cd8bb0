"""Which prefill and decode workers may exchange state."""

import pytest

from hybrid_pd.connector.compat import NO_SPECULATION, IncompatibleWorkers, WorkerIdentity, check_pair, check_worker


def _pair(**diff):
    base = dict(model="m", dtype="float32", block_size=128, tensor_parallel_size=1, conv_state_layout="DS", speculative_config=NO_SPECULATION)
    p = {**base, **{k[2:]: v for k, v in diff.items() if k.startswith("p_")}}
    d = {**base, **{k[2:]: v for k, v in diff.items() if k.startswith("d_")}}
    return WorkerIdentity(role="prefill", **p), WorkerIdentity(role="decode", **d)


def test_identical_workers_pair():
    check_pair(*_pair())


@pytest.mark.parametrize(
    ("diff", "field"),
    [
        ({"d_model": "other"}, "model"),
        ({"d_dtype": "bfloat16"}, "dtype"),
        ({"p_block_size": 64}, "block_size"),
        ({"p_conv_state_layout": "SD"}, "conv_state_layout"),
        ({"p_tensor_parallel_size": 2, "d_tensor_parallel_size": 3}, "tensor_parallel_size"),
        ({"d_pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        # MTP on the decode worker only: vLLM refuses the handshake, every request is prefilled twice.
        ({"d_speculative_config": '{"method":"mtp","num_speculative_tokens":2}'}, "speculative_config"),
        # Only the count differs: vLLM moves state the decode worker misreads (its conv state is longer).
        ({"p_speculative_config": '{"method":"mtp","num_speculative_tokens":1}',
          "d_speculative_config": '{"method":"mtp","num_speculative_tokens":3}'}, "speculative_config"),
    ],
)
def test_each_rule_names_its_field(diff, field):
    with pytest.raises(IncompatibleWorkers) as err:
        check_pair(*_pair(**diff))
    assert err.value.field == field
    assert field in str(err.value)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (4, 4)])
def test_tp_sizes_pair_when_one_divides_the_other(p_tp, d_tp):
    check_pair(*_pair(p_tensor_parallel_size=p_tp, d_tensor_parallel_size=d_tp))


def test_the_same_speculation_on_both_roles_pairs():
    mtp = '{"method":"mtp","num_speculative_tokens":2}'
    check_pair(*_pair(p_speculative_config=mtp, d_speculative_config=mtp))


def test_unknown_fields_are_not_guessed():
    check_pair(WorkerIdentity(role="prefill", model="m"), WorkerIdentity(role="decode", model="m", dtype="float32"))


def test_roles_must_be_prefill_then_decode_or_flex_on_either_side():
    p, d = _pair()
    with pytest.raises(IncompatibleWorkers, match=r"need a prefill \(or flex\) and a decode \(or flex\)"):
        check_pair(d, p)
    flex = WorkerIdentity(**{**p.to_json(), "role": "flex"})
    for prefill, decode in ((flex, d), (p, flex), (flex, flex)):
        check_pair(prefill, decode)


def test_single_worker_rules():
    with pytest.raises(IncompatibleWorkers, match="VLLM_SSM_CONV_STATE_LAYOUT=DS"):
        check_worker(WorkerIdentity(role="decode", model="m", conv_state_layout="SD"))


def test_identity_json_round_trip_ignores_unknown_keys():
    p, _ = _pair()
    assert WorkerIdentity.from_json({**p.to_json(), "extra": 1}) == p
