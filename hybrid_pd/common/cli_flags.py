"""Command-line flags derived from a pydantic settings model, so each setting is declared once.

A field ``side_channel_port: int | None = Field(..., description="...")`` becomes
``--side-channel-port SIDE_CHANNEL_PORT`` with ``type=int`` and the description as its
help; a ``bool`` becomes ``--x/--no-x``, a ``Literal`` a choice, a ``tuple`` or ``list`` a repeatable
flag. Every flag defaults to None, meaning "not given": the settings model then takes
the value from the environment or its own default, so a flag always wins over both.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["ENV_ONLY", "Flag", "add_flags", "flag_name", "given"]


@dataclass(frozen=True)
class Flag:
    """A setting's flag where its field name does not make it (``Annotated[..., Flag("--vllm-arg")]``).

    ``name=None``: the setting has no flag and comes from the environment only.
    """

    name: str | None


ENV_ONLY = Flag(None)


def flag_name(name: str, field: FieldInfo) -> str | None:
    """The flag of setting ``name`` (``--side-channel-port``), None for an environment-only one."""
    for meta in field.metadata:
        if isinstance(meta, Flag):
            return meta.name
    return "--" + name.replace("_", "-")


def _without_none(annotation: Any) -> Any:
    """``int`` for ``int | None``: a flag that is not given is None anyway."""
    if get_origin(annotation) in (Union, types.UnionType):
        (inner,) = [a for a in get_args(annotation) if a is not type(None)]
        return inner
    return annotation


def _argument(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field of type ``annotation``."""
    kind = _without_none(annotation)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(kind) is Literal:
        return {"choices": list(get_args(kind))}
    if get_origin(kind) in (tuple, list):
        return {"action": "append", **_argument(get_args(kind)[0])}
    return {} if kind is str else {"type": kind}


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Add one flag per field of ``model``, in field order; :data:`ENV_ONLY` fields get none."""
    for name, field in model.model_fields.items():
        flag = flag_name(name, field)
        if flag is None:
            continue
        help_text = field.description.replace("%", "%%") if field.description else None
        parser.add_argument(flag, dest=name, default=None, help=help_text, **_argument(field.annotation))


def given(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The values of ``model``'s fields that the command line gave; the rest comes from the environment or defaults."""
    return {n: getattr(args, n) for n in model.model_fields if getattr(args, n, None) is not None}
