"""Asking one OpenAI-compatible endpoint every prompt through ``/v1/completions``, concurrently.

Greedy decoding (temperature 0), lm-eval gsm8k's stop sequences, one prompt per request.
A failed request is not retried: it is recorded as an error (the point of the tool is to
notice a serving path that fails), and the caller counts and reports it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from hybrid_pd.eval.progress import Progress
from hybrid_pd.eval.prompts import STOP, truncate_at_stop

__all__ = ["EndpointError", "Generation", "Sampling", "base_url", "generate_all", "resolve_model"]

_ERROR_BODY_CHARS = 300


class EndpointError(Exception):
    """The endpoint cannot be evaluated at all (e.g. it lists no model)."""


@dataclass(frozen=True)
class Sampling:
    """What every completion request asks for, besides the prompt."""

    model: str
    max_tokens: int
    stop: tuple[str, ...] = STOP

    def body(self, prompt: str) -> dict[str, Any]:
        """The ``/v1/completions`` request body for ``prompt``."""
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stop": list(self.stop),
            "stream": False,
        }


@dataclass(frozen=True)
class Generation:
    """One prompt's answer: ``text`` when the request worked, ``error`` when it did not."""

    text: str | None
    error: str | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def base_url(endpoint: str) -> str:
    """The server root of ``endpoint``: ``http://h:8000``, ``.../v1`` and ``.../v1/completions`` all work."""
    url = endpoint.rstrip("/")
    for suffix in ("/completions", "/v1"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url


async def resolve_model(client: httpx.AsyncClient, endpoint: str) -> str:
    """The first model ``endpoint`` serves, from ``GET /v1/models``."""
    url = base_url(endpoint) + "/v1/models"
    try:
        response = await client.get(url)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise EndpointError(f"cannot list the models of {url} ({type(exc).__name__}: {exc}); pass --model") from exc


async def complete(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Generation:
    """One completion request; every failure becomes a :class:`Generation` with ``error`` set."""
    started = time.perf_counter()
    try:
        response = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        return Generation(None, f"{type(exc).__name__}: {exc}".rstrip(": "), latency_s=time.perf_counter() - started)
    latency = time.perf_counter() - started
    if response.status_code != 200:
        return Generation(None, f"HTTP {response.status_code}: {response.text[:_ERROR_BODY_CHARS]}", latency_s=latency)
    try:
        answer = response.json()
        choice = answer["choices"][0]
        text = choice["text"]
        if not isinstance(text, str):
            raise TypeError(f"choices[0].text is {type(text).__name__}")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return Generation(None, f"malformed response ({type(exc).__name__}: {exc})", latency_s=latency)
    usage = answer.get("usage") or {}
    return Generation(
        text=truncate_at_stop(text, body.get("stop") or ()),
        finish_reason=choice.get("finish_reason"),
        completion_tokens=usage.get("completion_tokens"),
        latency_s=latency,
    )


async def generate_all(
    client: httpx.AsyncClient,
    endpoint: str,
    prompts: Sequence[str],
    sampling: Sampling,
    concurrency: int,
    progress: Progress | None = None,
) -> list[Generation]:
    """Every prompt's generation from ``endpoint``, in prompt order, at most ``concurrency`` in flight."""
    url = base_url(endpoint) + "/v1/completions"
    results: list[Generation | None] = [None] * len(prompts)
    queue = iter(range(len(prompts)))

    async def worker() -> None:
        for i in queue:  # the workers share one iterator: each index is taken once
            results[i] = generation = await complete(client, url, sampling.body(prompts[i]))
            if progress is not None:
                progress.advance(error=not generation.ok)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(prompts))))))
    return [r for r in results if r is not None]
