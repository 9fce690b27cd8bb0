"""Workers on a vLLM that lacks a P/D piece: real workers, the piece taken out of the real vLLM.

A ``sitecustomize`` on ``PYTHONPATH`` patches a vLLM module as it is imported, in every
Python process of the test (the worker service, its capability probe, vLLM's API server,
engine and model workers), the way a vLLM without the piece behaves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from hybrid_pd.common.processes import free_port
from hybrid_pd.default_model import resolve_model
from hybrid_pd.stack import Stack, StackConfig

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


_SITECUSTOMIZE = """\
import importlib.util, sys


class _TakeOut:
    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
REMOVAL
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _TakeOut())
"""


def _without(folder: Path, module: str, removal: str) -> dict[str, str]:
    """The environment in which ``removal`` (code using ``module``) runs right after any process imports ``module``."""
    folder.mkdir(parents=True, exist_ok=True)
    code = _SITECUSTOMIZE.replace("MODULE", repr(module)).replace("REMOVAL", textwrap.indent(removal, " " * 12))
    (folder / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": f"{folder}:{REPO}"}


def test_a_worker_whose_vllm_lacks_a_piece_stops_naming_it(tmp_path):
    env = _without(tmp_path / "site", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
                   "del module.derive_mamba_conv_split")  # fmt: skip
    model, _ = resolve_model(None)
    argv = [sys.executable, "-m", "hybrid_pd.cli", "decode", "--model", model, "--port", str(free_port()),
            "--side-channel-port", str(free_port())]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, **env})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "lacks what hybrid P/D needs" in done.stderr
    assert "nixl_mamba_transfer: vLLM 0.32.0 lacks NIXL transfer of Mamba state" in done.stderr
    assert "0.26.0 (GPU), 0.32.0 (CPU) has it" in done.stderr
    assert "vLLM command" not in done.stderr, "vLLM was started anyway"


def test_without_the_decode_row_fix_the_connector_applies_it_and_says_so(tmp_path, monkeypatch, colocated: httpx.Client):
    # vLLM's reclassification taken out of this stack's workers: the decode worker's probe finds it
    # missing and our connector puts it back, in the engine, on its own. The reference is the session's
    # colocated server (a colocated server never has a pulled token N to reclassify).
    env = _without(tmp_path / "site", "vllm.v1.attention.backends.mamba_attn",
                   "from hybrid_pd.connector.vllm.decode_rows import remove_vllm_fix\nremove_vllm_fix()")  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.setenv("HYBRID_PD_HOME", str(tmp_path / "home"))  # a fresh probe, not an earlier result
    model, name = resolve_model(None)
    config = StackConfig(model=model, served_model_name=name, port=free_port(), log_dir=tmp_path / "logs", ready_timeout_s=600)
    with Stack(config) as stack:
        decode = stack.workers("decode")[0].url
        capability = httpx.get(decode + "/metrics", timeout=30).text
        assert 'hybrid_pd:capability{capability="decode_row_reclassification",state="fallback:connector"} 1.0' in capability
        assert 'hybrid_pd:capability{capability="nixl_mamba_transfer",state="vllm"} 1.0' in capability
        log = stack.log_path("decode-0").read_text()
        assert "FALLBACK capability=decode_row_reclassification fallback=connector" in log
        assert "counts token N after a pull as a prefill row" in log
        assert "hybrid-pd's connector applies its copy of vLLM's decode-row reclassification" in log
        body = {"model": name, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
        for prompt in ("Question: Maya has 41 beads. She buys 37 more beads. How many beads does Maya have now?\nAnswer:", "Hi"):
            routed = httpx.post(stack.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=300).json()
            local = colocated.post("/v1/completions", json={**body, "prompt": prompt}, timeout=300).json()
            assert routed["choices"][0]["token_ids"] == local["choices"][0]["token_ids"], prompt
