"""A fast fake vLLM OpenAI server: answers both legs of P/D, so a router in front of it is the bottleneck.

- ``POST /v1/completions`` (and ``/v1/chat/completions``) with ``kv_transfer_params.do_remote_decode``:
  the prefill leg; a one-token JSON answer carrying ``kv_transfer_params`` for the decode leg.
- Any other completion request: the decode leg (or a plain colocated server): ``max_tokens``
  tokens (default 16), as one JSON answer or, with ``stream``, one SSE event per token, then
  the usage event (``stream_options.include_usage``) and ``data: [DONE]``, as vLLM sends them.
- ``GET /health``, ``/v1/models``, ``/version``: what routers probe; ``GET /stats``: requests by kind.

No sleeps, events pre-encoded, a raw ASGI app (no framework) on uvicorn with uvloop and
httptools when installed. For tests, a prompt whose first token id is one of the ``FAIL_*``
ids fails on purpose.

Run: ``python -m hybrid_pd.bench.router.fake_upstream --port 9001 --port 9002`` (one process, any number of ports).
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

__all__ = ["FAIL_EVENT", "FAIL_HTTP", "FAIL_MIDSTREAM", "NO_USAGE", "FakeOpenAI", "serve_in_thread"]

FAIL_HTTP = 999_901  # answer 500
FAIL_MIDSTREAM = 999_902  # send two tokens, then drop the connection
FAIL_EVENT = 999_903  # send two tokens, then an OpenAI error event and [DONE]
NO_USAGE = 999_904  # stream without the usage event

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class FakeOpenAI:
    """The ASGI app. ``counts`` tallies requests by kind (prefill, decode_stream, decode_json, ...)."""

    def __init__(self, model: str = "fake-model", root: str | None = None) -> None:
        self.model = model
        self.counts: Counter[str] = Counter()
        self._models = _dumps({"object": "list", "data": [{"id": model, "object": "model", "root": root or model}]})
        self._events = {
            final: b"data: " + _dumps(self._chunk(" tok", "length" if final else None)) + b"\n\n"
            for final in (False, True)
        }

    def _chunk(self, text: str, finish: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": self.model, "choices": [choice]}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            await _respond(send, 200, b"", [])
        elif method == "GET" and path == "/v1/models":
            await _respond(send, 200, self._models)
        elif method == "GET" and path == "/version":
            await _respond(send, 200, b'{"version":"fake"}')
        elif method == "GET" and path == "/stats":
            await _respond(send, 200, _dumps(dict(self.counts)))
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            raw = await _read(receive)
            if raw:
                await self._completion(send, json.loads(raw))
            else:  # also what a client that went away mid-body gets (uvicorn drops it)
                await _respond(send, 400, _dumps({"error": {"message": "empty body", "code": 400}}))
        else:
            await _respond(send, 404, _dumps({"error": {"message": f"no route {method} {path}", "code": 404}}))

    async def _completion(self, send: Send, body: dict[str, Any]) -> None:
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt or body.get("messages"))) // 4)
        first = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else None
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            self.counts["prefill"] += 1
            answer = self._chunk(" tok", "length")
            answer["usage"] = _usage(prompt_tokens, 1)
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "fake-engine",
                "remote_block_ids": [0],
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            }
            await _respond(send, 200, _dumps(answer))
            return
        if first == FAIL_HTTP:
            self.counts["fail_http"] += 1
            await _respond(send, 500, _dumps({"error": {"message": "injected failure", "type": "InternalServerError"}}))
            return
        tokens = int(body.get("max_tokens") or 16)
        if not body.get("stream"):
            self.counts["decode_json"] += 1
            answer = self._chunk(" tok" * tokens, "length")
            answer["usage"] = _usage(prompt_tokens, tokens)
            await _respond(send, 200, _dumps(answer))
            return
        self.counts["decode_stream"] += 1
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        for i in range(tokens):
            if i == 2 and first == FAIL_MIDSTREAM:
                raise ConnectionAbortedError("injected: the stream breaks")  # uvicorn drops the connection
            if i == 2 and first == FAIL_EVENT:
                error = {"error": {"message": "injected error event", "type": "InternalServerError", "code": 500}}
                await _body(send, b"data: " + _dumps(error) + b"\n\ndata: [DONE]\n\n", more=False)
                return
            await _body(send, self._events[i == tokens - 1])
        if (body.get("stream_options") or {}).get("include_usage") and first != NO_USAGE:
            tail = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": self.model, "choices": []}
            tail["usage"] = _usage(prompt_tokens, tokens)
            await _body(send, b"data: " + _dumps(tail) + b"\n\n")
        await _body(send, b"data: [DONE]\n\n", more=False)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


async def _read(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Send, status: int, content: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS if headers is None else headers})
    await _body(send, content, more=False)


async def _body(send: Send, content: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": content, "more_body": more})


def _config(app: Any, **overrides: Any) -> uvicorn.Config:
    """uvloop and httptools when installed (uvicorn's "auto"), no access log; ``overrides`` go to ``uvicorn.Config``."""
    settings = {"log_level": "warning", "access_log": False, "lifespan": "off", "timeout_keep_alive": 300, **overrides}
    return uvicorn.Config(app, **settings)


@contextmanager
def serve_in_thread(app: Any, **overrides: Any) -> Iterator[str]:
    """Serve an ASGI ``app`` on a free port in a background thread of this process; yields its base URL.

    Used for the fake worker here and by tests for any app that needs a real socket
    (``lifespan="on"`` for the router, whose HTTP client lives in its lifespan).
    """
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(_config(app, **overrides))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    try:
        while not server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_pd.bench.router.fake_upstream", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, action="append", required=True, help="a port to listen on (repeatable)")
    parser.add_argument("--model", default="fake-model")
    args = parser.parse_args(argv)
    sockets = []
    for port in args.port:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, port))
        sockets.append(sock)
    uvicorn.Server(_config(FakeOpenAI(args.model))).run(sockets=sockets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
