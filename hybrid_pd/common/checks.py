"""What a setting's value must be, one check per kind of value, shared by the settings models and the CLI.

A check returns the value it accepts and raises ``ValueError`` with a sentence that says
what is wrong and what to give instead. The same check runs as a pydantic validator on a
settings model (``_ports = field_validator("port")(checks.tcp_port)``) and, through
:func:`hybrid_pd.common.arg_types.checked`, as an argparse type, so a bad value gets the
same answer from a flag and from the environment, before anything starts. ``None`` (a
setting left unset) passes every check.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

__all__ = ["fraction", "http_url", "json_object", "model_ref", "not_negative", "one_of", "output_dir", "output_file", "positive", "tcp_port"]

N = TypeVar("N", int, float)

# A Hugging Face Hub id: "name" or "org/name" (vLLM downloads it, or finds it in the HF cache).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def tcp_port(port: int | None) -> int | None:
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{port} is not a TCP port: give one from 1 to 65535")
    return port


def positive(value: N | None) -> N | None:
    if value is not None and not value > 0:
        raise ValueError(f"must be {'1 or more' if isinstance(value, int) else 'more than 0'}, got {value}")
    return value


def not_negative(value: N | None) -> N | None:
    if value is not None and value < 0:
        raise ValueError(f"must be 0 or more, got {value}")
    return value


def fraction(value: float | None) -> float | None:
    """A share of something, such as GPU memory: more than 0, at most 1."""
    if value is not None and not 0 < value <= 1:
        raise ValueError(f"must be a fraction in (0, 1], e.g. 0.9, got {value}")
    return value


def one_of(*choices: str) -> Callable[[str | None], str | None]:
    def check(value: str | None) -> str | None:
        if value is not None and value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return check


def http_url(url: str | None) -> str | None:
    """An ``http://host[:port]`` or ``https://...`` URL, without a trailing slash."""
    if url is None:
        return None
    parts = urlsplit(url)
    try:
        valid_port = parts.port is None or parts.port > 0
    except ValueError:  # a port that is not a number or out of range
        valid_port = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not valid_port:
        raise ValueError(f"{url!r} is not an http(s) URL: write it as http://host:port")
    return url.rstrip("/")


def json_object(text: str | None) -> str | None:
    """A JSON object, returned in one canonical form (sorted keys, compact): equal objects are equal strings."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at character {exc.pos}): give an object such as '{{\"method\": \"mtp\"}}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object: give an object such as '{{\"method\": \"mtp\"}}'")
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def model_ref(model: str | None) -> str | None:
    """A model vLLM can load: an existing local path, a Hugging Face Hub id (``org/name``), or empty (the default)."""
    if not model or Path(model).expanduser().exists() or (_HUB_ID.fullmatch(model) and not model.startswith(".")):
        return model
    raise ValueError(f"no model at {model}: give an existing model directory or a Hugging Face Hub id (org/name)")


def output_file(path: Path | None) -> Path | None:
    """A file this run writes at its end (its folder made when missing): checked at the start, not after a long run."""
    if path is not None:
        if path.is_dir():
            raise ValueError(f"{path} is a folder: give a file name")
        _writable_folder(path.absolute().parent, path)
    return path


def output_dir(path: Path | None) -> Path | None:
    """A folder this run writes into (made when missing)."""
    if path is not None:
        _writable_folder(path.absolute(), path)
    return path


def _writable_folder(folder: Path, given: Path) -> None:
    """``folder`` is, or can be made in, a folder this process may write to."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"cannot write {given}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {given}: the folder {existing} is not writable here")
