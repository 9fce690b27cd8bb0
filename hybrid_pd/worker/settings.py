"""A worker's settings, declared once: the environment (``HYBRID_PD_WORKER_*``), the flags and the spec.

Each field is one setting. ``hybrid-pd prefill|decode|colocated`` derive their flags
from the fields (:mod:`hybrid_pd.common.cli_flags`: the description is the flag's help),
and :meth:`WorkerSettings.spec` hands the ones the connector needs to
:class:`hybrid_pd.connector.launch.WorkerSpec` by name. The field order is the order of ``--help``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hybrid_pd.common import checks
from hybrid_pd.common.cli_flags import ENV_ONLY, Flag
from hybrid_pd.common.processes import free_port
from hybrid_pd.connector.contract import ENGINE_FIXES
from hybrid_pd.connector.launch import GPU_PULL_AWAIT_US, Device, Role, WorkerSpec, holds_in_scheduler
from hybrid_pd.connector.topology import rdma_devices
from hybrid_pd.default_model import resolve_model

__all__ = ["WorkerSettings"]

# The spec's fields: a setting of one of these names goes into the spec as it is.
_SPEC_FIELDS = {f.name for f in fields(WorkerSpec)}


class WorkerSettings(BaseSettings):
    """A worker's settings: environment (``HYBRID_PD_WORKER_*``) overridden by the CLI."""

    model_config = SettingsConfigDict(env_prefix="HYBRID_PD_WORKER_", protected_namespaces=())

    model: str = Field("", description="model directory (default: the embedded tiny hybrid model)")
    served_model_name: str | None = Field(None, description="the model name clients use (default: --model)")
    host: str = Field("127.0.0.1", description="HTTP bind address of the vLLM server")
    port: int = Field(8100, description="HTTP port of the vLLM server")
    side_channel_host: str = Field("127.0.0.1", description="address peers reach this worker's NIXL side channel on")
    side_channel_port: int = Field(5600, description="NIXL side-channel port (distinct per worker)")
    device: Device = Field("cpu", description="where vLLM runs")
    tensor_parallel_size: int = Field(1, description="tensor-parallel size of the vLLM server")
    dtype: str = Field("auto", description="the weights' dtype (auto: float32 on CPU)")
    max_model_len: int = Field(2048, description="vLLM's longest sequence, prompt and answer, in tokens")
    max_num_seqs: int = Field(8, description="requests vLLM runs at once")
    kv_cache_memory_bytes: int | None = Field(None, description="KV cache size (default: 512 MiB on CPU, vLLM's choice on GPU)")
    gpu_memory_utilization: float | None = Field(None, description="fraction of GPU memory vLLM may use (default: vLLM's)")
    cpu_threads_bind: str | None = Field(None, description="VLLM_CPU_OMP_THREADS_BIND for this server (CPU only)")
    ready_timeout_s: float = Field(900.0, description="seconds vLLM may take to become ready")
    kv_lease_s: int | None = Field(None, description="prefill: seconds to hold state nobody pulled (vLLM: 30)")
    ucx_net_devices: str | None = Field(
        None, description="UCX_NET_DEVICES for state transfer (default: the host's active RDMA ports on GPU)"
    )
    merge_descriptors: bool = Field(
        True, description="post NIXL reads that are adjacent on both sides as one descriptor (default: on)"
    )
    pull_await_us: int | None = Field(
        None,
        description="decode and flex: wait up to this many microseconds, in an engine step that posted a pull and runs "
        "no model, for the pull to complete, so vLLM notices it in that step instead of the next (default: "
        f"{GPU_PULL_AWAIT_US} on GPUs, 0 on CPU; 0: vLLM's behaviour)",
    )
    early_leg_hold: Literal["engine", "server", "scheduler"] = Field(
        "engine",
        description="decode and flex: where an early decode leg waits for the prefill's push: in vLLM's engine client, "
        "parsed and rendered meanwhile (where vLLM has the method), in the server before vLLM reads it, or in vLLM's "
        "scheduler, the push sent to the engine's own inbox (the engine steps while it waits)",
    )
    handoff_port: int | None = Field(
        None,
        description="decode and flex with --early-leg-hold scheduler: the port, on --side-channel-host, its engine takes "
        "the prefill's pushes on (default: a free one, picked at start); prefill workers must reach it, or their pushes "
        "go through this worker's server (the router asks them)",
    )
    nixl_trace_dir: str | None = Field(
        None, description="record every NIXL transfer into this folder (hybrid_pd/bench/nixl_floor.py replays it)"
    )
    timeline_dir: str | None = Field(
        None, description="prefill and decode: record when vLLM's server and engine saw each step of every P/D request into this folder (hand-off timeline)"
    )
    decode_row_fix: Literal["auto", "connector", "piecewise"] = Field(
        "auto",
        description="decode: where vLLM lacks the decode-row reclassification of token N, auto picks our connector's "
        "copy, else PIECEWISE CUDA graphs; connector or piecewise use that one regardless",
    )
    router_url: str | None = Field(
        None, description="register with this router (admin API) and heartbeat; several replicas: comma-separated URLs"
    )
    router_every_address: bool = Field(
        False,
        description="resolve each --router-url host on every heartbeat and register with every address it names "
        "(a Kubernetes headless Service: every router replica)",
    )
    advertise_url: str | None = Field(None, description="the URL the router reaches this worker's vLLM server at")
    # A secret: set in the environment only, a flag would show it in the process list.
    admin_token: Annotated[str | None, ENV_ONLY] = Field(None, description="Bearer token of the router's admin API")
    # Tuning the environment sets when needed; no flag of its own.
    heartbeat_interval_s: Annotated[float, ENV_ONLY] = Field(5.0, description="seconds between heartbeats to the router")
    drain_timeout_s: float = Field(30.0, description="on SIGTERM, wait this long for in-flight requests")
    # Why these defaults: docs/reliability.md (what start steps and serving were measured to take).
    start_stall_s: float | None = Field(
        None,
        gt=0,
        description="a starting vLLM whose start phase (weights, KV cache, HTTP server...) prints nothing, or that has "
        "a process stopped, for this many seconds is ended as hung, the phase named: the worker exits 3 (default: each "
        "phase's own budget, 80 s on CPU, 300 s on GPU)",
    )
    serve_stall_s: float = Field(
        60.0,
        gt=0,
        description="a serving vLLM whose /health fails, whose engine holds requests without progress (and leaves a "
        "one-token request unanswered), or that has a process stopped, for this many seconds is ended as hung: the "
        "worker exits 3",
    )
    speculative_config: str | None = Field(
        None,
        description="speculative decoding, vLLM's --speculative-config JSON (e.g. {\"method\": \"mtp\", "
        "\"num_speculative_tokens\": 2}); give the prefill and the decode worker the same one",
    )
    vllm_args: Annotated[tuple[str, ...], Flag("--vllm-arg")] = Field((), description="extra vLLM argument (repeatable)")
    skip_engine_fixes: Annotated[tuple[str, ...], Flag("--skip-engine-fix")] = Field(
        (),
        description="one of our vLLM plugin's fixes left out, for a measurement against vLLM's own behaviour "
        f"(repeatable: {', '.join(ENGINE_FIXES)}; docs/connector.md)",
    )

    # What each value must be, refused before vLLM starts (hybrid_pd/common/checks.py).
    _ports = field_validator("port", "side_channel_port", "handoff_port")(checks.tcp_port)
    _dtype = field_validator("dtype")(checks.one_of("auto", "half", "float16", "bfloat16", "float", "float32"))
    _counts = field_validator("tensor_parallel_size", "max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "kv_lease_s")(checks.positive)  # fmt: skip
    _memory = field_validator("gpu_memory_utilization")(checks.fraction)
    _seconds = field_validator("ready_timeout_s", "heartbeat_interval_s")(checks.positive)
    _drain = field_validator("drain_timeout_s", "pull_await_us")(checks.not_negative)
    _url = field_validator("advertise_url")(checks.http_url)
    _speculative = field_validator("speculative_config")(checks.json_object)

    @field_validator("skip_engine_fixes")
    @classmethod
    def _known_fixes(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(checks.one_of(*ENGINE_FIXES)(name) for name in names)

    @field_validator("vllm_args")
    @classmethod
    def _no_speculation_behind_the_routers_back(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        """Speculative decoding goes through ``--speculative-config``, which the router pairs workers by."""
        for arg in args:
            if arg.split("=", 1)[0] in ("--speculative-config", "--speculative_config", "-sc"):
                raise ValueError(f"{arg.split('=', 1)[0]} in --vllm-arg: use --speculative-config, which the router checks on both roles")
        return args

    @field_validator("router_url")
    @classmethod
    def _router_urls(cls, text: str | None) -> str | None:
        """Each comma-separated router URL is an http(s) URL (a replica each)."""
        return None if text is None else ",".join(checks.http_url(url.strip()) for url in text.split(","))

    @property
    def router_urls(self) -> tuple[str, ...]:
        """The router replicas ``--router-url`` names, in order, each once."""
        return tuple(dict.fromkeys(self.router_url.split(","))) if self.router_url else ()

    def spec(self, role: Role) -> WorkerSpec:
        """The connector's view of this worker (builds the default model if none is set).

        The model path and served name are resolved, on GPU the host's RDMA ports are
        read, and a scheduler-held decode worker without a hand-off port gets a free one;
        every other value is the setting of the same name.
        """
        model, served_model_name = resolve_model(self.model, self.served_model_name)
        found = {
            "role": role,
            "model": model,
            "served_model_name": served_model_name,
            "rdma_devices": rdma_devices() if self.device == "cuda" else (),
        }
        if holds_in_scheduler(self.early_leg_hold, role) and self.handoff_port is None:
            found["handoff_port"] = free_port()
        return WorkerSpec(**self.model_dump(include=_SPEC_FIELDS) | found)
