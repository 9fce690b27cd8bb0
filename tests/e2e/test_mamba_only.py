"""P/D of a pure-Mamba model (no attention layer): our connector (hybrid_pd/connector/vllm/nixl_connector.py).

vLLM 0.32's NIXL handshake dies with StopIteration for such models; with the
extension the state crosses NIXL and the answers equal a colocated server's. The colocated
answer is the decode worker's own for the same request without kv_transfer_params (it computes
the prompt itself, prefix caching off), as in the model matrix: a third vLLM costs CI ~25 s.
"""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from hybrid_pd.bench.gpu.model_matrix import FAILED
from hybrid_pd.common.processes import free_port
from hybrid_pd.default_model import resolve_model
from hybrid_pd.stack import Stack, StackConfig
from tests.e2e.support import make_handshakes, metric, settled, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def mamba_stack(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, Mamba2Config

    tokenizer_dir, _ = resolve_model(os.environ.get("HYBRID_PD_TEST_MODEL"))
    model_dir = tmp_path_factory.mktemp("mamba2")
    for name in os.listdir(tokenizer_dir):
        if "token" in name or name.endswith(".jinja"):
            shutil.copy(os.path.join(tokenizer_dir, name), model_dir / name)
    config = Mamba2Config(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_heads=8, head_dim=32, n_groups=2,
                          state_size=32, conv_kernel=4, expand=2, chunk_size=128, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    stack = Stack(StackConfig(model=str(model_dir), served_model_name="mamba2-tiny", port=free_port(),
                              log_dir=tmp_path_factory.mktemp("mamba-logs"), ready_timeout_s=600))  # fmt: skip
    with stack:
        make_handshakes(stack)
        yield stack


def test_the_workers_load_our_connector_extension(mamba_stack):
    prefill = mamba_stack.log_path("prefill-0").read_text()
    assert '"kv_connector_module_path":"hybrid_pd.connector.vllm.nixl_connector"' in prefill


def test_pure_mamba_pd_equals_colocated_and_moves_state(mamba_stack):
    decode = httpx.Client(base_url=mamba_stack.workers("decode")[0].url, timeout=120)
    body = {"model": "mamba2-tiny", "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_token_ids": True}
    with httpx.Client(timeout=180) as client:
        for prompt in ("Hello world, this is a pure Mamba model", [7, 8, 9, 10] * 40):
            before = metric(decode, "vllm:nixl_xfer_time_seconds_count")
            failed = metric(decode, FAILED)
            routed = client.post(mamba_stack.url + "/v1/completions", json={**body, "prompt": prompt}).json()["choices"][0]
            baseline = client.post(mamba_stack.workers("decode")[0].url + "/v1/completions", json={**body, "prompt": prompt})
            baseline = baseline.json()["choices"][0]
            assert routed["token_ids"] == baseline["token_ids"]
            worst = max(abs(a - b) for a, b in zip(routed["logprobs"]["token_logprobs"], baseline["logprobs"]["token_logprobs"]))
            assert worst <= 1e-4
            assert wait_for(lambda: metric(decode, "vllm:nixl_xfer_time_seconds_count") == before + 1, timeout_s=10)
            assert settled(lambda: metric(decode, "vllm:nixl_xfer_time_seconds_count")) == before + 1
            assert metric(decode, FAILED) == failed
    decode.close()
