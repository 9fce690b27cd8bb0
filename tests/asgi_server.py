"""An ASGI app served by uvicorn in a thread, for tests that need a real socket (router, scripted workers)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def serve_in_thread(app: Any, **config: Any) -> Iterator[str]:
    """Serve ``app`` on a free local port until the block ends; yields its base URL.

    ``config`` goes to ``uvicorn.Config`` (e.g. ``lifespan="off"`` for an app without one).
    """
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
