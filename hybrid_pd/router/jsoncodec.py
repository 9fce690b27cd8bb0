"""JSON as the router reads and writes it: compact UTF-8 out, and no NaN or Infinity either way.

One encoder serves everything the router writes (leg bodies, merged answers and events, error
answers): what Starlette's ``JSONResponse`` and httpx's ``json=`` wrote before it, so a worker and
a client see the same bytes whichever path made them. JSON has no NaN or Infinity; Python's
``json`` reads and writes them unless told not to, and a worker could not take them.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["ENCODER", "dumps", "loads_strict"]

ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON (``ValueError`` for NaN or Infinity)."""
    return ENCODER.encode(obj).encode()


def loads_strict(raw: bytes) -> Any:
    """``raw`` parsed as JSON; ``ValueError`` (``json.JSONDecodeError`` among them) for what JSON is not, NaN and Infinity too."""
    return json.loads(raw, parse_constant=_not_a_json_number, parse_float=_finite_float)


def _not_a_json_number(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is out of range for a JSON number")
    return value
