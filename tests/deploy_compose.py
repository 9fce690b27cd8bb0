"""Read the deployment files the way Docker reads them, for tests/test_deploy.py.

No Docker engine runs in the tests, so this module reproduces the parts of
Compose and of ``docker build`` the tests rely on: ``.env`` files, variable
interpolation (``${VAR:-default}`` and friends), merging several compose files,
``.dockerignore`` matching, and what a Dockerfile puts in an image (its programs,
``ENV``, ``USER``, copied files).
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "ROOT",
    "COMPOSE_FILE",
    "MULTINODE",
    "Dockerfile",
    "InterpolationError",
    "dockerignored",
    "interpolate",
    "interpolate_tree",
    "load_yaml",
    "merge",
    "parse_flags",
    "read_dotenv",
    "undocumented",
    "variables",
]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
MULTINODE = ROOT / "deploy" / "multinode"

# ---------------------------------------------------------------- .env files


def read_dotenv(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of an env file (comments and blank lines skipped, values literal)."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"{path.name}: not KEY=VALUE: {line!r}")
            env[key.strip()] = value
    return env


def undocumented(path: Path) -> list[str]:
    """Variables of an env file with no comment line right above them."""
    missing, previous = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and not previous.startswith("#"):
            missing.append(stripped.partition("=")[0])
        previous = stripped
    return missing


# ---------------------------------------------------------------- interpolation

_VAR = re.compile(r"\$(?:(?P<escaped>\$)|(?P<named>[_a-zA-Z][_a-zA-Z0-9]*)|\{(?P<braced>[^}]*)\})")
_BRACED = re.compile(r"^(?P<name>[_a-zA-Z][_a-zA-Z0-9]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$", re.S)


class InterpolationError(ValueError):
    """A ``${VAR:?message}`` whose variable is missing, or a malformed reference."""


def _substitute(braced: str, env: Mapping[str, str]) -> str:
    m = _BRACED.match(braced)
    if not m:
        raise InterpolationError(f"invalid interpolation ${{{braced}}}")
    name, op, arg = m.group("name"), m.group("op"), m.group("arg") or ""
    value = env.get(name)
    if op is None:
        return value or ""
    if op in (":-", "-"):
        unset = value is None or (op == ":-" and value == "")
        return arg if unset else value
    if op in (":?", "?"):
        if value is None or (op == ":?" and value == ""):
            raise InterpolationError(f"{name}: {arg or 'required'}")
        return value
    present = value is not None and (op == "+" or value != "")
    return arg if present else ""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``text`` with variables substituted the way Compose does (``$$`` is a literal ``$``)."""

    def one(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        if m.group("named"):
            return env.get(m.group("named")) or ""
        return _substitute(m.group("braced"), env)

    return _VAR.sub(one, text)


def variables(tree: Any) -> set[str]:
    """Names of the variables a YAML tree refers to (in values, as Compose interpolates)."""
    found: set[str] = set()
    if isinstance(tree, str):
        for m in _VAR.finditer(tree):
            if m.group("named"):
                found.add(m.group("named"))
            elif m.group("braced") is not None:
                braced = _BRACED.match(m.group("braced"))
                if braced is None:
                    raise InterpolationError(f"invalid interpolation in {tree!r}")
                found.add(braced.group("name"))
    elif isinstance(tree, Mapping):
        for value in tree.values():
            found |= variables(value)
    elif isinstance(tree, list):
        for value in tree:
            found |= variables(value)
    return found


def interpolate_tree(tree: Any, env: Mapping[str, str]) -> Any:
    """A copy of a YAML tree with every string value interpolated (keys are left alone)."""
    if isinstance(tree, str):
        return interpolate(tree, env)
    if isinstance(tree, Mapping):
        return {k: interpolate_tree(v, env) for k, v in tree.items()}
    if isinstance(tree, list):
        return [interpolate_tree(v, env) for v in tree]
    return tree


# ---------------------------------------------------------------- compose files


def load_yaml(path: Path) -> dict[str, Any]:
    """A compose file as Compose parses it (anchors and ``<<`` merge keys resolved), ``x-`` keys dropped."""
    data = yaml.safe_load(path.read_text())
    return {k: v for k, v in data.items() if not k.startswith("x-")}


# Keys whose value a later compose file replaces instead of merging.
_REPLACED = {"command", "entrypoint", "test"}


def merge(base: Any, override: Any, key: str = "") -> Any:
    """Merge compose trees like ``docker compose -f a -f b``: mappings merge, lists append, commands replace."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED:
        return base + [v for v in override if v not in base]
    return override


def parse_flags(args: Iterable[str]) -> list[tuple[str, str | None]]:
    """``(flag, value)`` pairs of an argv tail; ``--flag=value`` and ``--flag value`` both read."""
    pairs: list[tuple[str, str | None]] = []
    items = list(args)
    i = 0
    while i < len(items):
        token = items[i]
        if not token.startswith("--"):
            raise ValueError(f"positional argument {token!r} among flags")
        name, sep, value = token.partition("=")
        if sep:
            pairs.append((name, value))
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            pairs.append((name, items[i + 1]))
            i += 1
        else:
            pairs.append((name, None))
        i += 1
    return pairs


# ---------------------------------------------------------------- images


def _logical_lines(text: str) -> list[str]:
    lines, current = [], ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") and not current:
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        if current:
            lines.append(current)
        current = ""
    return lines


# Programs every image of a base family has.
_BASE_PROGRAMS = {"python": {"sh", "python", "python3", "pip"}, "nvidia/cuda": {"sh", "bash"}}


@dataclass
class Dockerfile:
    """What the final stage of a Dockerfile puts in its image, read statically."""

    path: Path
    base: str = ""
    env: dict[str, str] = field(default_factory=dict)
    user: str = "root"
    workdir: str = "/"
    runs: list[str] = field(default_factory=list)
    copies: list[tuple[list[str], str]] = field(default_factory=list)  # (sources, destination)

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        """The final stage; ``FROM ${ARG}`` reads the default of an ``ARG`` declared before it."""
        image, args = cls(path), {}
        for line in _logical_lines(path.read_text()):
            instruction, _, rest = line.partition(" ")
            instruction = instruction.upper()
            if instruction == "ARG" and not image.base:
                name, _, default = rest.strip().partition("=")
                args[name] = default
            elif instruction == "FROM":
                image = cls(path, base=interpolate(rest.split()[0], args))
            elif instruction == "ENV":
                for key, value in (kv.split("=", 1) for kv in shlex.split(rest)):
                    image.env[key] = value.replace("$PATH", image.env.get("PATH", ""))
            elif instruction == "USER":
                image.user = rest.strip()
            elif instruction == "WORKDIR":
                image.workdir = rest.strip()
            elif instruction == "RUN":
                image.runs.append(rest)
            elif instruction == "COPY":
                parts = [p for p in shlex.split(rest) if not p.startswith("--")]
                image.copies.append((parts[:-1], parts[-1]))
        return image

    def apt_packages(self) -> set[str]:
        """Packages the image installs with apt-get."""
        packages: set[str] = set()
        for run in self.runs:
            for command in re.split(r"&&|;", run):
                words = command.split()
                if words[:2] == ["apt-get", "install"]:
                    packages |= {w for w in words[2:] if not w.startswith("-")}
        return packages

    def pip_installs(self) -> list[list[str]]:
        """Arguments of every ``pip install`` the image runs."""
        found = []
        for run in self.runs:
            for command in re.split(r"&&|;", run):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    found.append(words[2:])
        return found

    def installs_project(self) -> bool:
        """Whether a ``pip install`` installs this project (``.`` with or without extras)."""
        return any(re.fullmatch(r"\.(\[[a-z,]+\])?", a) for args in self.pip_installs() for a in args)

    def programs(self) -> set[str]:
        """Programs on the image's PATH: from the base, apt, a venv on PATH, this project's scripts."""
        programs: set[str] = set()
        for family, names in _BASE_PROGRAMS.items():
            if self.base.split(":")[0] == family:
                programs |= names
        programs |= self.apt_packages() & {"curl", "wget", "python3"}
        venv = self.env.get("VIRTUAL_ENV", "")
        if venv and f"{venv}/bin" in self.env.get("PATH", "").split(":") and any("-m venv" in r for r in self.runs):
            programs |= {"python", "python3", "pip"}
        if self.installs_project():
            scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {})
            programs |= set(scripts)
        return programs

    def copied(self, source: str) -> bool:
        """Whether ``source`` (a path of the build context) is copied into the image."""
        return any(source in sources for sources, _ in self.copies)


# ---------------------------------------------------------------- .dockerignore


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(path: str, dockerignore: Path) -> bool:
    """Whether the build context leaves ``path`` out (the last matching pattern wins; ``!`` re-includes).

    A pattern that matches a parent directory matches everything below it, as in Docker.
    """
    patterns = [p.strip() for p in dockerignore.read_text().splitlines() if p.strip() and not p.startswith("#")]
    parents = ["/".join(path.split("/")[: i + 1]) for i in range(len(path.split("/")))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _glob_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(p) for p in parents):
            ignored = not negated
    return ignored
