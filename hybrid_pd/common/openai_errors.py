"""Errors in the OpenAI JSON format, with the HTTP status that goes with them."""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["OpenAIError", "error_body", "error_event"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None, err_type: str | None = None) -> dict:
    """``{"error": {...}}`` as OpenAI and vLLM send it; ``err_type`` replaces the type the status implies (vLLM's own names)."""
    err_type = err_type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code or status}}


def error_event(status: int, message: str) -> bytes:
    """An SSE event that ends a stream with an error, as vLLM does mid-stream."""
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n".encode()


@dataclass
class OpenAIError(Exception):
    """Raised anywhere in a request; the app turns it into an OpenAI error response."""

    status: int
    message: str
    param: str | None = None
    err_type: str | None = None

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, err_type=self.err_type)
