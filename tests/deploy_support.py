"""Deployment-test support shared by tests/test_deploy.py and tests/test_k8s.py (the dry_run fixture: tests/conftest.py).

What a container's environment is, and which `hybrid-pd <role>` commands `make demo` starts.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from hybrid_pd import default_model
from hybrid_pd import stack as stack_module
from hybrid_pd.cli import main
from hybrid_pd.stack import Service, Stack
from tests import deploy_compose as dc


@contextmanager
def container_environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment as a container's: its variables set, no stray HYBRID_PD_* settings."""
    with pytest.MonkeyPatch.context() as m:
        for key in list(os.environ):
            if key.startswith(("HYBRID_PD_WORKER_", "HYBRID_PD_ROUTER_")):
                m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        yield


RESOLVED_BY_THE_WORKER = {"--model", "--served-model-name"}
MASKED_FLAGS = {"--host", "--port", "--prefill", "--decode"}
MASKED_ENV = {"VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_CPU_OMP_THREADS_BIND"}


def masked_argv(argv: list[str]) -> list[str]:
    return [("<masked>" if i and argv[i - 1] in MASKED_FLAGS else a) for i, a in enumerate(argv)]


def make_demo_argv() -> list[str]:
    """The `hybrid-pd` arguments of the Makefile's `demo` recipe, its variables filled in."""
    makefile = (dc.ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+) \?= (.*)$", makefile, re.M))
    recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    (line,) = [ln for ln in recipe.splitlines() if "hybrid-pd " in ln]
    argv = line.split("hybrid-pd ", 1)[1].split()
    return [re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], a) for a in argv]


def make_demo_services(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """role -> the `hybrid-pd <role> ...` arguments `make demo` starts, planned by `hybrid-pd up` but not started."""
    planned: list[Service] = []

    class Planned(Stack):
        def start(self) -> None:
            planned.extend(self.services)
            raise KeyboardInterrupt  # `up` stops here, as on Ctrl-C

    monkeypatch.setattr(default_model, "ensure_default_model", default_model.default_model_dir)
    monkeypatch.setattr(stack_module, "Stack", Planned)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    assert main(make_demo_argv()) == 0
    return {s.name.split("-")[0]: s.argv[3:] for s in planned}
