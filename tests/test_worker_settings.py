"""A worker setting is declared once: its flag, its environment variable and its place in the spec follow from the field."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from hybrid_pd.cli import build_parser
from hybrid_pd.common.cli_flags import given
from hybrid_pd.connector.contract import HANDOFF_INBOX_ENV
from hybrid_pd.connector.identity import worker_identity
from hybrid_pd.connector.launch import WorkerSpec, build_launch
from hybrid_pd.worker import ROLES
from hybrid_pd.worker.settings import WorkerSettings

# The flags `hybrid-pd prefill|decode|colocated` have always had, in --help order.
FLAGS = [
    "--model", "--served-model-name", "--host", "--port", "--side-channel-host", "--side-channel-port", "--device",
    "--tensor-parallel-size", "--dtype", "--max-model-len", "--max-num-seqs", "--kv-cache-memory-bytes",
    "--gpu-memory-utilization", "--cpu-threads-bind", "--ready-timeout-s", "--kv-lease-s", "--ucx-net-devices",
    "--merge-descriptors", "--no-merge-descriptors", "--pull-await-us", "--early-leg-hold", "--handoff-port", "--nixl-trace-dir", "--timeline-dir", "--decode-row-fix", "--router-url",
    "--router-every-address", "--no-router-every-address", "--advertise-url",
    "--drain-timeout-s", "--start-stall-s", "--serve-stall-s", "--speculative-config", "--vllm-arg", "--skip-engine-fix", "--dry-run",
]  # fmt: skip


def _subparser(role: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[role]


@pytest.mark.parametrize("role", list(ROLES))
def test_each_role_has_the_same_flags_with_help(role):
    actions = [a for a in _subparser(role)._actions if a.option_strings and a.dest != "help"]
    assert [flag for a in actions for flag in a.option_strings] == FLAGS
    assert all(a.help for a in actions)


def _settings(argv: list[str]) -> WorkerSettings:
    return WorkerSettings(**given(build_parser().parse_args(["decode", *argv]), WorkerSettings))


def test_flags_parse_to_the_fields_types():
    settings = _settings(["--port", "9100", "--gpu-memory-utilization", "0.5", "--device", "cuda", "--no-merge-descriptors",
                          "--vllm-arg=--foo", "--vllm-arg", "bar"])  # fmt: skip
    assert (settings.port, settings.gpu_memory_utilization, settings.device) == (9100, 0.5, "cuda")
    assert settings.merge_descriptors is False
    assert settings.vllm_args == ("--foo", "bar")
    assert _settings(["--pull-await-us", "800"]).pull_await_us == 800
    with pytest.raises(ValueError, match="0 or more"):
        _settings(["--pull-await-us", "-1"])


def test_a_flag_wins_over_the_environment_which_wins_over_the_default(monkeypatch):
    monkeypatch.setenv("HYBRID_PD_WORKER_PORT", "9000")
    monkeypatch.setenv("HYBRID_PD_WORKER_MERGE_DESCRIPTORS", "false")
    monkeypatch.setenv("HYBRID_PD_WORKER_VLLM_ARGS", '["--a", "b"]')
    from_env = _settings([])
    assert (from_env.port, from_env.merge_descriptors, from_env.vllm_args) == (9000, False, ("--a", "b"))
    assert _settings(["--port", "9100", "--merge-descriptors"]).port == 9100
    assert _settings(["--merge-descriptors"]).merge_descriptors is True
    monkeypatch.delenv("HYBRID_PD_WORKER_PORT")
    assert _settings([]).port == WorkerSettings.model_fields["port"].default


def test_secrets_and_tuning_come_from_the_environment_only(monkeypatch):
    monkeypatch.setenv("HYBRID_PD_WORKER_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("HYBRID_PD_WORKER_HEARTBEAT_INTERVAL_S", "2")
    settings = _settings([])
    assert (settings.admin_token, settings.heartbeat_interval_s) == ("s3cret", 2.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--admin-token", "x"])


def test_the_spec_takes_every_setting_it_shares_by_name(tmp_path):
    settings = WorkerSettings(model=str(tmp_path), served_model_name="m", port=9, side_channel_port=7, dtype="half", max_num_seqs=3,
                              kv_lease_s=5, merge_descriptors=False, nixl_trace_dir="/t", vllm_args=("--x",))  # fmt: skip
    spec = settings.spec("prefill")
    shared = {f.name for f in fields(WorkerSpec)} & set(WorkerSettings.model_fields)
    assert shared >= {"port", "dtype", "vllm_args", "merge_descriptors", "kv_lease_s"}
    assert {n: getattr(spec, n) for n in shared} == {n: getattr(settings, n) for n in shared}
    assert (spec.role, spec.seed, spec.rdma_devices) == ("prefill", 0, ())


def test_a_decode_worker_whose_scheduler_holds_early_legs_gets_a_free_port_for_its_inbox_unless_given_one(tmp_path):
    held = WorkerSettings(model=str(tmp_path), served_model_name="m", side_channel_host="10.0.0.7", early_leg_hold="scheduler")
    picked = held.spec("decode").handoff_port
    assert picked and picked != held.spec("decode").handoff_port  # a free port, picked per start
    assert held.spec("prefill").handoff_port is None  # a prefill holds no early legs
    given = held.model_copy(update={"handoff_port": 6123}).spec("flex")
    assert worker_identity(given, block_size=None).handoff_inbox == "tcp://10.0.0.7:6123"
    assert build_launch(given).env[HANDOFF_INBOX_ENV] == "tcp://10.0.0.7:6123"
    engine_held = WorkerSettings(model=str(tmp_path), served_model_name="m").spec("decode")
    assert engine_held.handoff_port is None and worker_identity(engine_held, block_size=None).handoff_inbox is None


def test_the_speculative_config_is_one_canonical_json_object_and_only_given_by_its_flag():
    settings = _settings(["--speculative-config", '{ "num_speculative_tokens": 2, "method": "mtp" }'])
    assert settings.speculative_config == '{"method":"mtp","num_speculative_tokens":2}'  # equal objects, equal strings
    for bad in ("mtp", "[1, 2]"):
        with pytest.raises(ValueError, match="object"):
            WorkerSettings(speculative_config=bad)
    # Through --vllm-arg the router could not see it, and would pair workers vLLM cannot hand state between.
    for args in (("--speculative-config", "{}"), ('--speculative-config={"method":"mtp"}',)):
        with pytest.raises(ValueError, match="use --speculative-config"):
            WorkerSettings(vllm_args=args)


def test_without_a_model_the_spec_serves_the_embedded_one():
    spec = WorkerSettings().spec("decode")
    assert spec.served_model_name == "hybrid-pd-tiny" and spec.model.endswith("hybrid-pd-tiny")


def test_an_engine_fix_left_out_must_be_one_of_ours():
    assert WorkerSettings(skip_engine_fixes=("detok_suffix",)).skip_engine_fixes == ("detok_suffix",)
    with pytest.raises(ValueError, match="not one of"):
        WorkerSettings(skip_engine_fixes=("detok",))
