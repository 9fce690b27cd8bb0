"""The import rules of docs/architecture.md, checked: the router runs without vLLM, torch, NIXL or the worker.

The router image installs the project without extras (deploy/router.Dockerfile); a router
module that imported any of these would work here, where everything is installed, and fail
there. Each router module is imported in a fresh interpreter in which those packages
cannot be found.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import services.router

FORBIDDEN = ("vllm", "torch", "nixl", "transformers", "services.worker")

_BLOCKER = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == f or name.startswith(f + ".") for f in {FORBIDDEN!r}):
            raise ModuleNotFoundError(f"{{name}} is not installed in the router image")
sys.meta_path.insert(0, Block())
"""

ROUTER_MODULES = sorted(f"services.router.{m.name}" for m in pkgutil.iter_modules(services.router.__path__))


def test_every_router_module_imports_without_the_worker_side():
    imports = "".join(f"import {module}\n" for module in ROUTER_MODULES)
    done = subprocess.run([sys.executable, "-c", _BLOCKER + imports], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(ROUTER_MODULES) > 10  # the package was found


def test_the_blocker_blocks():
    done = subprocess.run([sys.executable, "-c", _BLOCKER + "import services.worker.run"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "not installed in the router image" in done.stderr
