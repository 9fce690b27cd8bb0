"""The admin API: workers register, heartbeat, drain and leave; operators list them.

Every route needs ``Authorization: Bearer <admin token>``; without a configured
token the admin API is off (404), so a router is never open to registration by accident.
"""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, ValidationError, field_validator

from hybrid_pd.common.openai_errors import OpenAIError
from hybrid_pd.connector.compat import IncompatibleWorkers, WorkerIdentity
from hybrid_pd.router.registry import RoleName, Worker, probe_identity
from hybrid_pd.router.state import RouterState

__all__ = ["WorkerRegistration", "admin_routes"]


class WorkerRegistration(BaseModel):
    """What a worker sends to join: where it is, its role and (optionally) its identity."""

    url: str = Field(description="base URL of the worker's vLLM OpenAI server")
    role: RoleName
    identity: dict[str, Any] | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        return url.rstrip("/")


def admin_routes(state: RouterState) -> APIRouter:
    """Routes under ``/admin`` bound to ``state``."""
    router = APIRouter(prefix="/admin")
    registry = state.registry

    def authorize(request: Request) -> None:
        token = state.settings.admin_token
        if not token:
            raise OpenAIError(404, "the admin API is disabled (set HYBRID_PD_ROUTER_ADMIN_TOKEN)")
        if request.headers.get("authorization", "") != f"Bearer {token}":
            raise OpenAIError(401, "missing or invalid admin token")

    def worker_or_404(worker_id: str) -> Worker:
        worker = registry.get(worker_id)
        if worker is None:
            raise OpenAIError(404, f"no worker {worker_id!r}")
        return worker

    @router.get("/workers")
    async def list_workers(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"workers": [w.view() for w in registry.all()]}

    @router.post("/workers", status_code=201)
    async def register(request: Request) -> dict[str, Any]:
        authorize(request)
        try:
            reg = WorkerRegistration.model_validate_json(await request.body())
        except ValidationError as exc:
            raise OpenAIError(400, f"invalid registration: {exc.errors()[0]['msg']}") from exc
        if reg.identity is not None:
            identity = WorkerIdentity.from_json({**reg.identity, "role": reg.role})
        else:
            try:
                identity = await probe_identity(state.upstream, reg.url, reg.role)
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                raise OpenAIError(400, f"cannot read the worker's identity at {reg.url}: {type(exc).__name__}") from exc
        try:
            worker = registry.add(Worker(url=reg.url, role=reg.role, identity=identity))
        except IncompatibleWorkers as exc:
            raise OpenAIError(409, f"worker refused: {exc}", param=exc.field) from exc
        await registry.check(worker, state.upstream)  # routed to once its server has answered, not before
        return worker.view()

    @router.post("/workers/{worker_id}/heartbeat")
    async def heartbeat(worker_id: str, request: Request) -> dict[str, Any]:
        authorize(request)
        worker = worker_or_404(worker_id)
        registry.touch(worker)
        return worker.view()

    @router.post("/workers/{worker_id}/drain")
    async def drain(worker_id: str, request: Request) -> dict[str, Any]:
        authorize(request)
        worker = worker_or_404(worker_id)
        worker.draining = True
        return worker.view()

    @router.delete("/workers/{worker_id}")
    async def deregister(worker_id: str, request: Request) -> dict[str, Any]:
        authorize(request)
        worker = worker_or_404(worker_id)
        registry.remove(worker.id)
        return {"removed": worker.id}

    return router
