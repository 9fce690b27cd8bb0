"""Our vLLM plugin reaches a vLLM server started from a source tree (hybrid_pd.worker.plugin_registration).

On the GPU kit nothing of ours is installed: vLLM found no entry point of ours and no engine fix was ever
applied there (2026-11-28). These tests fail on the worker that spawned vLLM with the launch's environment as is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_pd.connector.contract import DETOK_SUFFIX, ENGINE_FIXES_ENV
from hybrid_pd.worker import plugin_registration, run
from hybrid_pd.worker.plugin_registration import ENTRY_POINT, GROUP, register_in

# What vLLM's plugin loader sees: the entry points of the group, in a Python without site-packages (nothing installed).
LIST_PLUGINS = f"from importlib.metadata import entry_points; print(sorted(e.value for e in entry_points(group={GROUP!r})))"


def plugins_seen(pythonpath: str, cwd: Path) -> str:
    """Run where no checkout is (a checkout's ``*.egg-info`` declares the plugin too)."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-S", "-c", LIST_PLUGINS], env=env, cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_a_python_with_nothing_installed_sees_our_plugin_through_the_folder_written(tmp_path: Path) -> None:
    folder = tmp_path / "plugin"
    assert plugins_seen("", tmp_path) == "[]"
    assert plugins_seen(str(register_in(folder)), tmp_path) == repr([ENTRY_POINT])
    assert plugins_seen(str(register_in(folder)), tmp_path) == repr([ENTRY_POINT])  # written again by the next worker: still one


def test_where_hybrid_pd_is_installed_the_worker_leaves_the_environment_alone() -> None:
    assert plugin_registration.registered()  # this test environment has it installed (make install)
    env = {ENGINE_FIXES_ENV: DETOK_SUFFIX}
    assert run.with_plugin(env) == env


def test_a_worker_from_a_source_tree_puts_the_plugin_and_the_tree_on_vllms_pythonpath(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(plugin_registration, "registered", lambda: False)
    monkeypatch.setattr(plugin_registration.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = run.with_plugin({ENGINE_FIXES_ENV: DETOK_SUFFIX, "OTHER": "1"})
    folder, source, before = env["PYTHONPATH"].split(os.pathsep)
    assert (env[ENGINE_FIXES_ENV], env["OTHER"], before) == (DETOK_SUFFIX, "1", "/elsewhere")
    assert Path(source, "hybrid_pd", "connector", "vllm", "plugin.py").is_file()
    assert plugins_seen(folder, tmp_path) == repr(["hybrid_pd.connector.vllm.plugin:load"])  # pyproject.toml's entry point
    assert run.with_plugin({"OTHER": "1"}) == {"OTHER": "1"}  # no fix named: nothing to load
