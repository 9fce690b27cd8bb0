"""What the rules outside vLLM and our hooks inside it agree on: environment names and shared constants.

The worker service (:mod:`hybrid_pd.connector.launch`) sets these variables in vLLM's
environment; the modules vLLM loads (:mod:`hybrid_pd.connector.vllm`) read them. Both sides
import the names from here, so neither imports the other.
"""

from __future__ import annotations

__all__ = [
    "AWAIT_ENV",
    "EARLY_LEG_HOLD_ENV",
    "CAPABILITIES_ENV",
    "CONV_STATE_LAYOUT",
    "CPU_PREFIX_CACHING",
    "DECODE_ROW",
    "DELAY_ENV",
    "DETOK_SUFFIX",
    "ENGINE_FIXES",
    "ENGINE_FIXES_ENV",
    "FAILED_PULLS",
    "HANDOFF_INBOX_ENV",
    "HANDOFF_KEY_HEADER",
    "HANDOFF_KEY_PARAM",
    "HANDOFF_PATH",
    "HANDOFF_REACH_QUERY",
    "HANDOFF_URL_PARAM",
    "IDLE_POLL",
    "LOCAL_PROMPT_TOKENS",
    "MERGE_ENV",
    "SHM_SPIN",
    "TEST_ONLY_DISABLE_ENV",
    "TIMELINE_DIR_ENV",
    "TIMELINE_SOURCE_ENV",
    "TRACE_ENV",
]

# The conv-state layout both roles must use. The DS layout, (dim, state_len), is the
# one vLLM's NIXL connector can transfer for Mamba layers (and split across TP ranks).
CONV_STATE_LAYOUT = "DS"

# Prompts of at most this many tokens are computed by the decode worker alone, with no pull
# (hybrid_pd.connector.vllm.nixl_connector). A one-token prompt has no h(N-1): the prefill cannot stop at 0
# tokens. For a two-token prompt the prefill would compute N-1 = 1 token as a one-token prompt,
# which vLLM answers from stale state under FULL CUDA graphs (vllm-project/vllm#57720; a plain
# vLLM 0.26 server on an H100 gave the same 1-token prompt 3 different greedy answers in 3 runs,
# 2- and 3-token prompts identical), so P/D parted from colocated at the first token there.
LOCAL_PROMPT_TOKENS = 2

# The start-up check's decisions, {piece: "vllm" | "fallback:<how>"} as JSON
# (hybrid_pd.connector.vllm.capabilities), and the pieces the rules act on.
CAPABILITIES_ENV = "HYBRID_PD_CAPABILITIES"
DECODE_ROW = "decode_row_reclassification"
FAILED_PULLS = "failed_pull_reporting"

# NIXL hooks, each switched on by its variable (hybrid_pd.connector.vllm.*).
DELAY_ENV = "HYBRID_PD_NIXL_PROGRESS_DELAY_US"  # nixl_progress: microseconds between progress polls
MERGE_ENV = "HYBRID_PD_NIXL_MERGE_DESCRIPTORS"  # nixl_merge: "1" posts adjacent reads as one
TRACE_ENV = "HYBRID_PD_NIXL_TRACE_DIR"  # nixl_trace: folder of the transfer trace
AWAIT_ENV = "HYBRID_PD_PULL_AWAIT_US"  # pull_await: microseconds a step waits for its own pulls
EARLY_LEG_HOLD_ENV = "HYBRID_PD_EARLY_LEG_HOLD"  # handoff: "server" holds early decode legs there, not in vLLM's engine client
HANDOFF_INBOX_ENV = "HYBRID_PD_HANDOFF_INBOX"  # scheduler_hold: tcp://host:port, where the decode engine takes pushes; set, its scheduler holds early legs
TEST_ONLY_DISABLE_ENV = "HYBRID_PD_TEST_ONLY_DISABLE_DECODE_ROW_FIX"  # decode_rows: the negative control

# Fixes of vLLM's engine our vLLM plugin applies in every process of a server that names them, comma-separated
# (hybrid_pd.connector.vllm.plugin): "cpu_prefix_caching" (hybrid_pd.connector.vllm.cpu_prefix_caching),
# "shm_spin" (hybrid_pd.connector.vllm.shm_spin), "detok_suffix" (hybrid_pd.connector.vllm.detok_suffix),
# "idle_poll" (hybrid_pd.connector.vllm.idle_poll).
ENGINE_FIXES_ENV = "HYBRID_PD_ENGINE_FIXES"
CPU_PREFIX_CACHING = "cpu_prefix_caching"
SHM_SPIN = "shm_spin"
DETOK_SUFFIX = "detok_suffix"
IDLE_POLL = "idle_poll"
ENGINE_FIXES = (CPU_PREFIX_CACHING, SHM_SPIN, DETOK_SUFFIX, IDLE_POLL)  # each the name of its module, applied in this order

# The hand-off timeline (hybrid_pd.connector.trace): its folder, and which role writes.
TIMELINE_DIR_ENV = "HYBRID_PD_TIMELINE_DIR"
TIMELINE_SOURCE_ENV = "HYBRID_PD_TIMELINE_SOURCE"

# The early decode leg (hybrid_pd.connector.vllm.handoff): the router sends the decode leg with the prefill leg; the
# prefill's engine pushes the state's whereabouts (its kv_transfer_params) to the decode worker's vLLM server at
# HANDOFF_PATH the moment the prefill ends, where the early leg waits for them. A worker whose server answers
# GET HANDOFF_PATH with 200 takes part; where its engine takes the pushes itself (scheduler_hold), the answer's JSON
# names that inbox ({"handoff": 1, "inbox": "tcp://host:port"}); pushes POSTed to such a server are relayed there. Asked
# GET HANDOFF_PATH?HANDOFF_REACH_QUERY=tcp://host:port, a worker's server says whether its host opens a connection there
# ({"handoff": 1, "reaches": true}): the router sends pushes to an inbox only once the prefill worker reaches it
# (hybrid_pd.router.inbox_reach). The legs' kv_transfer_params name the hand-off:
HANDOFF_PATH = "/hybrid_pd/handoff"
HANDOFF_REACH_QUERY = "reach"
HANDOFF_KEY_PARAM = "hybrid_pd_handoff_key"  # both legs: the pair's key, the same on both
HANDOFF_URL_PARAM = "hybrid_pd_handoff_url"  # the prefill leg: where to push (the decode worker's vLLM server, or its engine's inbox)
# The early decode leg says so in this header too: the decode worker's server reads the body of such a leg only, and
# lets every other request through to vLLM as it came.
HANDOFF_KEY_HEADER = "x-hybrid-pd-handoff-key"
