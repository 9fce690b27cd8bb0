"""Our router with experimental changes patched in at start, to measure what each suggested optimisation saves.

Nothing here is used by the router itself: these are prototypes for ``docs/performance.md``'s
suggestions, measured with ``python -m hybrid_pd.bench.router.overhead --paths 'hybrid-pd,hybrid-pd[orjson]'``.

    python -m hybrid_pd.bench.router.variants VARIANT[+VARIANT...] router --port ... (the ``hybrid-pd`` arguments)

Variants:

- ``asis``: unchanged.
- ``plain``: uvicorn on asyncio's loop and h11 (what uvicorn falls back to without uvloop and
  httptools, which the router now declares).
- ``orjson``: orjson for the request body, the legs' bodies, the prefill answer,
  usage events and JSON answers.

The ``aiohttp`` (legs through aiohttp) and ``rawrelay`` (decode stream relayed as bytes)
prototypes became the router's own code (``hybrid_pd/router/upstream.py``, ``relay_one`` in
``hybrid_pd/router/relay.py``) and left this module.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

VARIANTS = ("asis", "plain", "orjson")


def _plain() -> None:
    import uvicorn

    uvicorn.run = functools.partial(uvicorn.run, loop="asyncio", http="h11")


def _orjson() -> None:
    import httpx._content
    import httpx._models
    import orjson
    from starlette.responses import JSONResponse

    import hybrid_pd.router.jsoncodec as jsoncodec
    import hybrid_pd.router.relay as relay

    class _Json:
        JSONDecodeError = json.JSONDecodeError  # orjson.JSONDecodeError subclasses it

        @staticmethod
        def loads(data: Any, **_: Any) -> Any:
            return orjson.loads(data)

        @staticmethod
        def dumps(obj: Any, **_: Any) -> str:
            return orjson.dumps(obj).decode()

    jsoncodec.json = relay.json = _Json  # type: ignore[assignment]
    jsoncodec.ENCODER.encode = _Json.dumps  # type: ignore[method-assign] - the one encoder every module writes with
    httpx._models.jsonlib = _Json  # type: ignore[attr-defined]
    httpx._content.json_dumps = _Json.dumps  # type: ignore[attr-defined]
    JSONResponse.render = lambda self, content: orjson.dumps(content)  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit(__doc__)
    variants = args[0].split("+")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    for variant in variants:
        {"asis": lambda: None, "plain": _plain, "orjson": _orjson}[variant]()
    from hybrid_pd.cli import main as cli_main

    return cli_main(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
