#!/bin/bash
# Issue #35 on two H100s (vLLM 0.26 from ../shared/gpu): the hand-off tax before and after early decode legs, one set of
# servers, Nemotron-H-8B at its published size. On each GPU a colocated server and a flexible worker (the goodput
# runner's servers, as in the four-GPU run of issue #34); systems, each a router of its own per point:
#   replicas          the two colocated servers
#   1P1D              flex0 prefills, flex1 decodes; the router sends the decode leg with the prefill leg (the default now)
#   1P1D-sequential   the same workers, --no-early-decode: the legs one after the other, as before
# Points (vLLM's own client, --ignore-eos; every router records its own hand-off events, --router-timeline):
#   1000/32 @ 1 and 8000/32 @ 1, 24 prompts each: TTFT and the router's spans (prefill leg, decode leg, the prefill's
#   answer to the decode's first byte) at one request in flight; 1000/512 @ 64, 256 prompts: TPOT and throughput.
# Run from the checkout's root on the GPU machine, the kit's third call and the calls right after it:
#   call 3: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100x2-handoff/run.sh start
#   call 4: bash /tmp/site/.gpu-payload/unpack.sh --all || exit; source /tmp/site/.gpu-payload/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100x2-handoff/run.sh wait 500; bash hybrid_pd/bench/results/2026-11-27-h100x2-handoff/run.sh pack
# Stages: start (model, servers, bench detached), status, wait [S], pack ($OUT/results.tar.gz), down.
set -u
STAGE=${1:-status}
DIR=${DIR:-/tmp/h100x2-handoff}
MODEL=/tmp/full/nemotron_h
export PYTHONPATH=$PWD:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
COMMON=(--out $DIR --model $MODEL --device cuda --gpus 2 --max-model-len 9216 --kv-cache-gib 14 --gpu-memory-utilization 0.47
        --max-num-seqs 128 --systems replicas,1P1D,1P1D-sequential --slo 500/20 --slo 1500/50)
POINTS=1000/32@1x24:500/20,8000/32@1x24:1500/50,1000/512@64x256:500/20
RUNNER=(python3 -m hybrid_pd.bench.gpu.goodput)
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
running() { [ -f $DIR/bench.pid ] && kill -0 "$(cat $DIR/bench.pid)" 2>/dev/null; }
status() {
  if running; then echo "bench: running"; elif [ -f $DIR/bench.rc ]; then echo "bench: ended, rc $(cat $DIR/bench.rc)"; else echo "bench: not started"; fi
  [ -f $DIR/bench.out ] && grep -E '^\[[0-9]+/[0-9]+\]|Error|Traceback' $DIR/bench.out | tail -6
}
case $STAGE in
start)
  mkdir -p $DIR
  nvidia-smi -L > $DIR/gpus.txt
  python3 -c "import vllm, torch, nixl; print('vllm', vllm.__version__, 'torch', torch.__version__)" > $DIR/versions.txt 2>&1
  if [ ! -f $MODEL/config.json ]; then
    python3 -m hybrid_pd.models.families /tmp/full --full nemotron_h --max-position 65536 > $DIR/build.log 2>&1 || { log "build failed"; cat $DIR/build.log; exit 1; }
  fi
  log "model ready"
  "${RUNNER[@]}" up "${COMMON[@]}" >> $DIR/up.log 2>&1 || { log "servers did not start"; tail -20 $DIR/up.log; exit 1; }
  log "$(tail -1 $DIR/up.log)"
  setsid nohup bash -c "${RUNNER[*]} run ${COMMON[*]} --points $POINTS --router-timeline; echo \$? > $DIR/bench.rc" >> $DIR/bench.out 2>&1 < /dev/null &
  echo $! > $DIR/bench.pid
  log "bench started"
  ;;
status) status ;;
wait)
  LIMIT=${2:-500}
  while running && [ $(($(date +%s) - T0)) -lt "$LIMIT" ]; do sleep 20; log "$(grep -E '^\[[0-9]+/[0-9]+\]' $DIR/bench.out 2>/dev/null | tail -1)"; done
  status
  running && exit 1
  exit 0
  ;;
pack)
  "${RUNNER[@]}" report "${COMMON[@]}" > $DIR/report.txt 2>&1
  cat $DIR/report.txt
  "${RUNNER[@]}" pack "${COMMON[@]}" --to "${OUT:?set OUT (the device call sets it)}/results.tar.gz"
  ;;
down)
  running && kill -TERM -- -"$(cat $DIR/bench.pid)"
  "${RUNNER[@]}" down "${COMMON[@]}"
  ;;
*) echo "usage: $0 start | status | wait [SECONDS] | pack | down" >&2; exit 2 ;;
esac
