"""A worker whose vLLM cannot start exits non-zero with vLLM's error, not a wall of log."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybrid_pd.common.processes import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_worker_exits_nonzero_with_the_error_lines_when_vllm_fails(tmp_path):
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    argv = [sys.executable, "-m", "hybrid_pd.cli", "decode", "--model", str(broken), "--port", str(free_port()),
            "--side-channel-port", str(free_port())]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=500)
    assert result.returncode != 0
    summary = result.stderr.split("vLLM ended", 1)
    assert len(summary) == 2, result.stderr[-2000:]
    lines = summary[1].strip().splitlines()
    assert 1 <= len(lines) <= 13, "a few lines, not the whole log"
    assert any("no_such_architecture" in line or "Error" in line for line in lines)
