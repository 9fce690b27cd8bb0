"""docs/configuration.md, written from the settings models: each setting's flag, variable, default and meaning.

The settings are declared once (:mod:`hybrid_pd.router.settings`, :mod:`hybrid_pd.worker.settings`,
``hybrid-pd up``'s parser); their flags are derived from them (:mod:`hybrid_pd.common.cli_flags`),
and so is this reference. ``python -m hybrid_pd.config_doc > docs/configuration.md``
rewrites it; ``tests/test_config_doc.py`` fails when the file and the models drift apart. It sits
beside the CLI, not in ``common``: it reads every service's settings and the CLI's parser, which
shared code must not import.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from hybrid_pd.cli import build_parser
from hybrid_pd.common.cli_flags import flag_name
from hybrid_pd.router.settings import RouterSettings
from hybrid_pd.worker import ROLES
from hybrid_pd.worker.settings import WorkerSettings

__all__ = ["render"]

_INTRO = """# Configuration reference

<!-- Written by `python -m hybrid_pd.config_doc > docs/configuration.md`; edit the settings models, not this file. -->

Every service reads its settings from the environment and lets command-line flags override them.
Lists in the environment are JSON (`HYBRID_PD_ROUTER_DECODE='["http://d0:8200", "http://d1:8200"]'`).
A setting without a flag is set in the environment only (a secret, or tuning rarely needed).
`hybrid-pd router|prefill|decode|colocated --dry-run` prints what the settings resolve to.
"""


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value in (None, [], (), ""):
        return "none"
    return f"`{value}`"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def settings_table(model: type[BaseModel]) -> str:
    """One row per field: flag (or none), environment variable, default, the field's description."""
    prefix = model.model_config.get("env_prefix", "")
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        flag = flag_name(name, field)
        rows.append(
            f"| {f'`{flag}`' if flag else '(environment only)'} | `{prefix}{name.upper()}` | {_cell(_default(field))} | {_cell(field.description)} |"
        )
    return "\n".join(rows)


def parser_table(parser: argparse.ArgumentParser) -> str:
    """One row per option of a plain argparse parser (``hybrid-pd up``, which has no settings model)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        default = "none" if action.default in (None, False) else f"`{action.default}`"
        choices = f" ({' / '.join(map(str, action.choices))})" if action.choices else ""
        rows.append(f"| `{action.option_strings[-1]}` | {default} | {_cell(action.help)}{choices} |")
    return "\n".join(rows)


def render() -> str:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    sections = [
        _INTRO,
        "## `hybrid-pd up`: a whole deployment on this machine\n\n" + parser_table(commands.choices["up"]),
        "## Router: `hybrid-pd router`\n\n" + settings_table(RouterSettings),
        f"## Workers: `hybrid-pd {'|'.join(ROLES)}`\n\n"
        + "".join(f"- `{role}`: {summary}\n" for role, summary in ROLES.items())
        + "\n"
        + settings_table(WorkerSettings),
    ]
    return "\n\n".join(s.strip() for s in sections) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
