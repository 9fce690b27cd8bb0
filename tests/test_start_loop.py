"""The start loop's reading of worker logs: the longest silence of each of vLLM's start phases (hybrid_pd.bench.start_loop)."""

from hybrid_pd.bench.start_loop import longest_silences

# A worker's log as it is written: its own lines, vLLM's, torch's (lines from a 2026-11-27 start, times kept).
LOG = """\
2026-11-27 03:34:39,370 INFO hybrid_pd.worker [-] starting vLLM role=prefill port=26616 side_channel=30068
W1127 03:35:17.615000 15995 torch/_library/triton.py:53] Triton not available, find_triton_kernels = []
(APIServer pid=15995) INFO 11-27 03:35:18 [api_utils.py:286] non-default args: {'port': 26616}
(EngineCore pid=16388) INFO 11-27 03:36:05 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='m'
(EngineCore pid=16388) WARNING 11-27 03:36:50 [shm_broadcast.py:871] No available shared memory broadcast block found in 60 seconds.
(Worker pid=16560) INFO 11-27 03:36:59 [cpu_model_runner.py:68] Starting to load model m...
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 11.93it/s]
(Worker pid=16560) INFO 11-27 03:36:59 [default_loader.py:501] Loading weights took 0.09 seconds
(Worker pid=16560) INFO 11-27 03:37:21 [ssu_dispatch.py:635] Using cpu Mamba SSU backend.
(EngineCore pid=16388) INFO 11-27 03:37:32 [core.py:402] init engine (profile, create kv cache, warmup model) took 28.05 s
INFO:     Application startup complete.
2026-11-27 03:37:34,426 INFO hybrid_pd.worker [-] ready role=prefill url=http://127.0.0.1:26616
2026-11-27 03:39:00,000 INFO hybrid_pd.worker [-] serving, long after: not a start
2026-11-27 03:40:00,000 INFO hybrid_pd.worker [-] starting vLLM role=prefill port=26616 side_channel=30068
(APIServer pid=2) INFO 11-27 03:40:30 [api_utils.py:286] non-default args: {'port': 26616}
2026-11-27 03:41:00,000 ERROR hybrid_pd.worker [-] vLLM ended (role=prefill pid=2): ...
"""


def test_each_silence_belongs_to_the_phase_it_was_spent_in_waiting_lines_and_serving_aside(tmp_path):
    (tmp_path / "prefill-0.log").write_text(LOG)
    found = {name: seconds for name, (seconds, _) in longest_silences([tmp_path / "prefill-0.log"]).items()}
    assert found == {
        "starting its API server (imports, configuration)": 38,
        "starting its engine core process": 47,
        "starting its model worker processes": 54,  # the engine core's waiting line is no progress
        "loading the weights": 0,
        "profiling, allocating the KV cache and warming up (compile, registration)": 22,
        "capturing CUDA graphs": 0,
        "starting its HTTP server": 0,
        "answering /health": 0,
    }
