"""Server-sent events as vLLM writes them, cut into lines: what the router's relay and our bench client both read."""

from __future__ import annotations

from collections.abc import AsyncIterator

__all__ = ["sse_lines"]


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` cut into lines, without their LF or CRLF (how vLLM ends SSE lines).

    JSON text holds neither raw, so a line is never cut inside an event; a text's U+2028 or
    U+0085, which ``str.splitlines`` (and httpx's ``aiter_lines``) would cut at, stays in its line.
    """
    pending = b""
    async for data in chunks:
        pending += data
        if b"\n" not in data:
            continue
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line[:-1] if line.endswith(b"\r") else line
    if pending:
        yield pending
