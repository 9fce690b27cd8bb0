"""Stop working for a client that went away, as soon as it goes.

While the router waits for its workers (the prefill leg, the decode worker's first
byte, a whole non-streamed answer, the next event of a stream), nobody reads from the
client's connection. A client that disconnects then would leave vLLM generating for
nobody and the prefill worker holding state for a pull that never comes.
:func:`cancel_on_disconnect` cancels the waiting instead: the legs' connections close,
which is how vLLM learns to abort. One watcher covers a request from its body read to
its answer's last event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.types import Receive

from hybrid_pd.common.openai_errors import OpenAIError

__all__ = ["cancel_on_disconnect"]

log = logging.getLogger("hybrid_pd.router")


@asynccontextmanager
async def cancel_on_disconnect(receive: Receive) -> AsyncIterator[None]:
    """Run the block in the current task; cancel it if the client disconnects, and raise a 499.

    ``receive`` is the request's ASGI receive, its body already read: the next message
    a server sends is ``http.disconnect``, when the client goes. One task waits for it
    (no polling) and is cancelled as the block ends. A cancellation that does not come
    from here (the server shutting down) goes through unchanged.
    """
    task = asyncio.current_task()
    assert task is not None, "cancel_on_disconnect runs inside a task"
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass  # nothing else can come once the body is read; ignore it rather than guess
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except asyncio.CancelledError:
        # uncancel() drops our own cancellation; anything left is someone else's.
        if not gone or task.uncancel() > 0:
            raise
        log.info("client disconnected before the answer; request cancelled")
        raise OpenAIError(499, "client disconnected") from None
    finally:
        watcher.cancel()
