#!/bin/bash
# Issue #35, the cut measured: early decode legs held in vLLM's engine client (parsed and rendered during the prefill, the
# default) against held in the decode worker's server (--early-leg-hold=server, the before), in one run on one GPU (an
# H200: four Nemotron-H-8B servers at their published size do not fit an H100's 80 GB), vLLM 0.26 from ../shared/gpu:
# a prefill worker, a decode worker (engine hold), a second decode worker (server hold) and a colocated server sharing
# the GPU, every P/D process recording its timeline; 1000- and 8000-token prompts, 32 output tokens, 1 in flight,
# 32 prompts each: P/D against colocated, then the sequential legs (a router with --no-early-decode) against P/D, then
# the server-held decode worker behind a router of its own against P/D (same prefill), each with the budgets of both.
# Calls (the machine goes cold ~30 s after a call: never leave a gap):
#   call 3: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash hybrid_pd/bench/results/2026-11-27-h200-handoff-engine-hold/run.sh start
#   call 4: bash /tmp/site/.gpu-payload/unpack.sh --all >/dev/null || exit; source /tmp/site/.gpu-payload/env.sh; bash hybrid_pd/bench/results/2026-11-27-h200-handoff-engine-hold/run.sh wait 540; bash hybrid_pd/bench/results/2026-11-27-h200-handoff-engine-hold/run.sh pack
# The same stages as the H100 script (start, wait [S], pack), with four servers' memory shares and the third variant.
GPU_MEM=0.22 VARIANTS="--variant sequential:router=--no-early-decode --variant server:decode=--early-leg-hold=server" \
  DIR=${DIR:-/tmp/handoff-hold} exec bash "$(dirname "$0")/../2026-11-27-h100-handoff-early-timeline/run.sh" "$@"
