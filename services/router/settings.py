"""The router's settings: environment (``HYBRID_PD_ROUTER_*``) overridden by the CLI."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    log_level: str = "INFO"

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL must start with http:// or https:// (got {url!r})")
        return [url.rstrip("/") for url in urls]
