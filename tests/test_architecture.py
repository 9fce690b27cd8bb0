"""The import rules of docs/architecture.md, checked.

- The router runs without vLLM, torch, NIXL, transformers, the worker or the connector's
  worker-side parts: the router image installs the project without extras
  (deploy/router.Dockerfile), so a router module that imported any of these would work here,
  where everything is installed, and fail there. Each router module is imported in a fresh
  interpreter in which they cannot be found.
- No two modules import each other (a module that needs another's parts and is needed by it is
  one module, or two with a third they share).
- Shared code (``hybrid_pd.common``) imports nothing of the project outside it: the services
  build on it, not it on them (the configuration reference, which reads every service's
  settings, sits beside the CLI).
- The connector's rules (what the worker service runs) import nothing of vLLM at module level
  and nothing of the hooks vLLM loads; the hooks import of the rules' side only the contract
  both share and the trace: neither side depends on the other.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import hybrid_pd.connector
import hybrid_pd.connector.vllm
import hybrid_pd.router

CONNECTOR = Path(hybrid_pd.connector.__file__).parent
ENGINE_SIDE = ("vllm", "torch", "nixl", "transformers")
# What the router may use of the connector: the pairing rules, the contract they rest on, and the trace.
ROUTER_MAY_IMPORT = ("hybrid_pd.connector.compat", "hybrid_pd.connector.contract", "hybrid_pd.connector.trace")


def _blocker(forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> str:
    return f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == a or name.startswith(a + ".") for a in {allowed!r}):
            return None
        if any(name == f or name.startswith(f + ".") for f in {forbidden!r}):
            raise ModuleNotFoundError(f"{{name}} is not installed in this image")
sys.meta_path.insert(0, Block())
"""


def _import_all(modules: list[str], forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    code = _blocker(forbidden, allowed) + "".join(f"import {module}\n" for module in modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


ROUTER_MODULES = sorted(f"hybrid_pd.router.{m.name}" for m in pkgutil.iter_modules(hybrid_pd.router.__path__))
RULE_MODULES = sorted(
    f"hybrid_pd.connector.{m.name}" for m in pkgutil.iter_modules(hybrid_pd.connector.__path__) if not m.ispkg
) + ["hybrid_pd.connector.trace.http", "hybrid_pd.connector.trace.timeline"]
HOOK_FILES = sorted(p for p in (CONNECTOR / "vllm").glob("*.py") if p.name != "__init__.py")


def test_every_router_module_imports_without_the_worker_side():
    forbidden = (*ENGINE_SIDE, "hybrid_pd.worker", "hybrid_pd.connector")
    done = _import_all(ROUTER_MODULES, forbidden, allowed=("hybrid_pd.connector", *ROUTER_MAY_IMPORT))
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(ROUTER_MODULES) > 10  # the package was found


def test_the_connector_rules_import_neither_vllm_nor_the_hooks():
    done = _import_all(RULE_MODULES, (*ENGINE_SIDE, "hybrid_pd.connector.vllm"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"hybrid_pd.connector.launch", "hybrid_pd.connector.plan", "hybrid_pd.connector.contract"} <= set(RULE_MODULES)


def _hybrid_pd_imports(path: Path) -> set[str]:
    """Every ``hybrid_pd`` module ``path`` imports, at module level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybrid_pd"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("hybrid_pd"))
    return names


def test_the_hooks_import_only_the_contract_the_trace_and_each_other():
    allowed = ("hybrid_pd.connector.contract", "hybrid_pd.connector.trace", "hybrid_pd.connector.vllm")
    found = {p.name: sorted(m for m in _hybrid_pd_imports(p) if not m.startswith(allowed)) for p in HOOK_FILES}
    assert {name: bad for name, bad in found.items() if bad} == {}
    assert "nixl_connector.py" in found


def test_the_blocker_blocks():
    done = _import_all(["hybrid_pd.worker.run"], (*ENGINE_SIDE, "hybrid_pd.worker"))
    assert done.returncode != 0 and "not installed in this image" in done.stderr
    done = _import_all(["hybrid_pd.connector.launch"], ("hybrid_pd.connector.plan",))
    assert done.returncode != 0 and "not installed in this image" in done.stderr


def _project_imports(path: Path) -> set[str]:
    """The ``hybrid_pd`` modules ``path`` imports, at any depth of its code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "hybrid_pd" or n.startswith("hybrid_pd.")}


def test_shared_code_imports_only_shared_code():
    common = Path(hybrid_pd.connector.__file__).parent.parent / "common"
    reaching_up = {p.name: sorted(i for i in _project_imports(p) if not i.startswith("hybrid_pd.common")) for p in common.glob("*.py")}
    assert {name: up for name, up in reaching_up.items() if up} == {}
    assert len(reaching_up) > 5  # the package was found


def test_no_two_modules_import_each_other():
    package = Path(hybrid_pd.connector.__file__).parent.parent
    imports: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        found = _project_imports(path)
        for node in ast.walk(ast.parse(path.read_text())):  # `from hybrid_pd.sizing import check` names a module too
            if isinstance(node, ast.ImportFrom) and node.module in found:
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
        imports[name] = found
    mutual = {tuple(sorted((a, b))) for a, found in imports.items() for b in found if b != a and a in imports.get(b, ())}
    assert mutual == set()
    assert len(imports) > 100  # the package was found
