#!/bin/bash
# Issue #35, "see it": the hand-off timeline of the early decode leg on one GPU (H100, vLLM 0.26 from ../shared/gpu),
# Nemotron-H-8B at its published size; a prefill worker, a decode worker and a colocated server sharing the GPU, every
# P/D process recording its timeline (--timeline-dir); 1000- and 8000-token prompts, 32 output tokens, 1 in flight,
# 32 prompts each: P/D (early decode legs, the default) against colocated, then the same workers behind a router with
# --no-early-decode (the legs one after the other) against P/D, each with the budgets of both.
# Under load: LEVELS=16 PROMPTS_PER_IN_FLIGHT=4 DIR=/tmp/handoff-early-c16 (64 prompts a row). GPU_MEM and VARIANTS: other
# servers' memory share and perf_sweep variants (../2026-11-27-h200-handoff-engine-hold/run.sh runs this script so).
# Calls (the machine goes cold ~30 s after a call: never leave a gap):
#   call 3: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100-handoff-early-timeline/run.sh start
#   call 4: bash /tmp/site/.gpu-payload/unpack.sh --all >/dev/null || exit; source /tmp/site/.gpu-payload/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100-handoff-early-timeline/run.sh wait 540; bash hybrid_pd/bench/results/2026-11-27-h100-handoff-early-timeline/run.sh pack
set -u
STAGE=${1:-status}
DIR=${DIR:-/tmp/handoff-early}
LEVELS=${LEVELS:-1} PROMPTS_PER_IN_FLIGHT=${PROMPTS_PER_IN_FLIGHT:-32} GPU_MEM=${GPU_MEM:-0.3}
VARIANTS=${VARIANTS:---variant sequential:router=--no-early-decode}
MODEL=/tmp/full/nemotron_h
export PYTHONPATH=$PWD:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
running() { [ -f $DIR/sweep.pid ] && kill -0 "$(cat $DIR/sweep.pid)" 2>/dev/null; }
case $STAGE in
start)
  mkdir -p $DIR
  nvidia-smi -L > $DIR/gpus.txt
  python3 -c "import vllm, torch, nixl; print('vllm', vllm.__version__, 'torch', torch.__version__)" > $DIR/versions.txt 2>&1
  if [ ! -f $MODEL/config.json ]; then
    python3 -m hybrid_pd.models.families /tmp/full --full nemotron_h --max-position 65536 > $DIR/build.log 2>&1 || { log "build failed"; tail -20 $DIR/build.log; exit 1; }
  fi
  log "model ready"
  setsid nohup bash -c "python3 -m hybrid_pd.bench.gpu.perf_sweep --out $DIR/sweep --layouts one-gpu --levels $LEVELS --input-len 1000,8000 \
      --output-len 32 --prompts-per-request-in-flight $PROMPTS_PER_IN_FLIGHT --timeline --no-floor --model $MODEL --gpu-memory-utilization $GPU_MEM \
      --kv-cache-gib 4 --max-model-len 9216 $VARIANTS; echo \$? > $DIR/sweep.rc" \
    >> $DIR/sweep.out 2>&1 < /dev/null &
  echo $! > $DIR/sweep.pid
  log "sweep started"
  bash "$0" wait 450
  ;;
wait)
  while running && [ $(($(date +%s) - T0)) -lt "${2:-540}" ]; do
    sleep 15
    log "$(grep -E '^one-gpu|ready|Error|Traceback' $DIR/sweep.out 2>/dev/null | tail -1 | cut -c1-200)"
  done
  running && { log "still running"; exit 1; }
  log "sweep ended, rc $(cat $DIR/sweep.rc 2>/dev/null)"
  ;;
pack)
  running && kill -TERM -- -"$(cat $DIR/sweep.pid)"
  tail -c 20000 $DIR/sweep.out
  tar -C $(dirname $DIR) -czf "${OUT:?set OUT (the device call sets it)}/results.tar.gz" --exclude='*.jsonl' $(basename $DIR)
  tar -C $(dirname $DIR) -czf "$OUT/timeline.tar.gz" $(basename $DIR)/sweep/timeline 2>/dev/null
  ls -la $OUT
  ;;
*)
  echo "usage: $0 start | wait [SECONDS] | pack" >&2
  exit 2
  ;;
esac
