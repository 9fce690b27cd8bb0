"""How the chaos load judges each answer (hybrid_pd.bench.chaos.checked_load), against a stand-in router."""

from __future__ import annotations

import asyncio
import json

from hybrid_pd.bench.chaos import checked_load
from hybrid_pd.bench.router.fake_upstream import serve_in_thread

EXPECTED = {"a prompt": [5, 6, 7]}


async def _router(scope, receive, send) -> None:  # noqa: ANN001 - ASGI
    """Whole answers right; streams right but cut before ``[DONE]``: the ending the chaos test saw once on a slow host."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    stream = json.loads(body)["stream"]
    if stream:
        events = "".join(f"data: {json.dumps({'choices': [{'token_ids': [t]}]})}\n\n" for t in EXPECTED["a prompt"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": events.encode()})
        return
    answer = json.dumps({"choices": [{"token_ids": EXPECTED["a prompt"]}]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": answer})


def test_a_stream_without_done_is_unclean_and_says_how_it_ended():
    why: list[str] = []
    with serve_in_thread(_router) as url:
        counts = asyncio.run(checked_load(url, "m", EXPECTED, requests=4, concurrency=2, unclean=why))
    assert counts == {"correct": 2, "unclean": 2}
    assert len(why) == 2 and all(w.startswith("stream: HTTP 200") and "token_ids" in w for w in why), why
