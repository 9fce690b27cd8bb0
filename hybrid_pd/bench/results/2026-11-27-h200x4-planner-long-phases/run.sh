#!/bin/bash
# The four-GPU run of issue 34, fourth: the phases at ~60 s each (the third run's ~35 s made the planner pay its "burst per
# move" in a larger share of each phase), after the third run's two fixes (a pause ends a phase; every system settles), and
# with the shipped profile (nemotron-h-8b-h100, refit from the first four-GPU run). 4x H100 80GB or H200, vLLM 0.26 from
# ../shared/gpu: Nemotron-H-8B at its published size, one set of servers (a colocated server and a flexible worker per GPU):
#   1. phase-shifting traffic, back to back through one router per system: replicas, 2P2D (the best fixed layout over the
#      third run's phases, 2.40 against 1P3D's 1.76; 3P1D 0.44 in the second run) and the planner: chat 1000/512 @ 128 in
#      flight asking 500/20 ms -> documents 16000/256 @ 32 asking 4000/15 -> chat again; each request names its phase's SLO
#      (x-slo-ttft-ms / x-slo-tpot-ms). 1280 chat and 384 document prompts: ~55-85 s a phase (the third run's rates);
#      longer phases do not fit one session's device time (1920/576, ~90 s: ~1640 s with the kit).
#      Simulated first (CPU, ~15 s): planner 3.57, 2P2D 2.67, replicas 1.19 goodput per GPU (1.34x 2P2D; 1.39x at ~90 s):
#        hybrid-pd size --profile nemotron-h-8b-h100 --gpus 4 --slo-ttft-ms 500 --slo-tpot-ms 20 \
#          --phases 1000/512@128x1280:500/20,16000/256@32x384:4000/15,1000/512@128x1280:500/20
#   2. the point the third run left out, 32000/128 @ 16 under 4000/15 (replicas, 3P1D, planner), every system settled first,
#   3. 1000/512 @ 64 under 500/20 (replicas, planner), where the planner must keep whole requests; every system settled
#      first now (the third run settled the planner alone, which made it look 1.5x the replicas there),
#   4. one request at a time, 1000/64 @ 1, 16 prompts (replicas, 1P3D, planner): issue 34's TTFT <= replicas + 5 ms.
# Device time, estimated from the third run: kit calls ~2 min, model build + 8 servers ~5 min, phases ~12 min,
# points ~3 min, pack ~1 min: ~23 min.
# Run from the checkout's root on the GPU machine, the kit's third call and the calls right after it (the machine goes
# cold ~30 s after a call: never leave a gap):
#   call 3: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash hybrid_pd/bench/results/2026-11-27-h200x4-planner-long-phases/run.sh start
#   call 4: bash /tmp/site/.gpu-payload/unpack.sh --all >/dev/null || exit; source /tmp/site/.gpu-payload/env.sh; bash hybrid_pd/bench/results/2026-11-27-h200x4-planner-long-phases/run.sh wait 570
#   call 5: (same prefix) ... run.sh wait S; ... run.sh pack   (S leaves ~60 s of device time for the pack)
# Stages:
#   start          build the model (max position 65536) unless built, the eight servers (returns once all answer,
#                  ~4-5 min), then `bench` detached
#   bench          the phases, then the points: `goodput run`s one after another, detached (setsid nohup), output in $DIR/bench.out
#   status         servers, whether the bench runs, the last lines of its output
#   wait [S]       status every 20 s until the bench ends or S seconds (default 540) pass; exit 0 once it ended
#   pack           the tables so far ($DIR/report.txt) and one archive of the results: $OUT/results.tar.gz
#   down           stop the bench and the servers
set -u
STAGE=${1:-status}
DIR=${DIR:-/tmp/h200x4-planner-long-phases}
MODEL=/tmp/full/nemotron_h
PROFILE=hybrid_pd/sizing/profiles/nemotron-h-8b-h100.json  # shipped; its cache_bytes are the servers' 14 GiB
export PYTHONPATH=$PWD:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
SERVERS=(--out $DIR --model $MODEL --device cuda --gpus 4 --max-model-len 33280 --kv-cache-gib 14 --gpu-memory-utilization 0.47
         --max-num-seqs 128 --slo 500/20 --slo 1500/50 --planner-profile $PROFILE)
# PHASE_SYSTEMS, LONG_POINTS, POINTS and ONE_POINT may be cut to fit the device time left (POINTS= : none); the run's record says which ran
PHASE_SYSTEMS=${PHASE_SYSTEMS:-replicas,2P2D,planner}
PHASES=1000/512@128x1280:500/20,16000/256@32x384:4000/15,1000/512@128x1280:500/20
LONG_SYSTEMS=replicas,3P1D,planner
LONG_POINTS=${LONG_POINTS-32000/128@16:4000/15}
MATRIX_SYSTEMS=replicas,planner
POINTS=${POINTS-1000/512@64:500/20}
ONE_SYSTEMS=replicas,1P3D,planner
ONE_POINT=${ONE_POINT-1000/64@1:500/20}
RUNNER=(python3 -m hybrid_pd.bench.gpu.goodput)
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
running() { [ -f $DIR/bench.pid ] && kill -0 "$(cat $DIR/bench.pid)" 2>/dev/null; }

status() {
  if [ -f $DIR/servers.json ]; then
    python3 -c "import json; s = json.load(open('$DIR/servers.json')); print('servers up (ready in', s['ready_s'], 's):', ', '.join(s['servers']))"
  else
    echo "servers: not up"
  fi
  if running; then echo "bench: running (pid $(cat $DIR/bench.pid))"; elif [ -f $DIR/bench.rc ]; then echo "bench: ended, rc $(cat $DIR/bench.rc)"; else echo "bench: not started"; fi
  if [ -f $DIR/bench.out ]; then
    grep -E '^\[[0-9]+/[0-9]+\]|^  .* phase |Error|Traceback|FAILED' $DIR/bench.out | tail -6
  fi
}

case $STAGE in
start)
  mkdir -p $DIR
  nvidia-smi -L > $DIR/gpus.txt
  python3 -c "import vllm, torch, nixl; print('vllm', vllm.__version__, 'torch', torch.__version__)" > $DIR/versions.txt 2>&1
  if [ ! -f $MODEL/config.json ]; then
    python3 -m hybrid_pd.models.families /tmp/full --full nemotron_h --max-position 65536 > $DIR/build.log 2>&1 || { log "build failed"; cat $DIR/build.log; exit 1; }
  fi
  python3 -c "import json, sys; c = json.load(open('$MODEL/config.json')); sys.exit(c['max_position_embeddings'] != 65536)" || { log "$MODEL: max_position_embeddings is not 65536"; exit 1; }
  log "model ready"
  python3 -c "import json, sys; sys.exit(json.load(open('$PROFILE'))['cache_bytes'] != 14 << 30)" || { log "$PROFILE: cache_bytes is not the servers' 14 GiB"; exit 1; }
  "${RUNNER[@]}" up "${SERVERS[@]}" --systems $PHASE_SYSTEMS,3P1D,1P3D >> $DIR/up.log 2>&1 || { log "servers did not start"; tail -20 $DIR/up.log $DIR/serve.log; exit 1; }
  log "$(tail -1 $DIR/up.log)"
  bash "$0" bench
  ;;
bench)
  running && { log "the bench runs already (pid $(cat $DIR/bench.pid))"; exit 1; }
  rm -f $DIR/bench.rc
  LONG="true" MATRIX="true" ONE="true"
  [ -n "$LONG_POINTS" ] && LONG="${RUNNER[*]} run ${SERVERS[*]} --systems $LONG_SYSTEMS --points $LONG_POINTS --prompts-per-in-flight 2 --settle-prompts-per-in-flight 1"
  [ -n "$POINTS" ] && MATRIX="${RUNNER[*]} run ${SERVERS[*]} --systems $MATRIX_SYSTEMS --points $POINTS --prompts-per-in-flight 2 --settle-prompts-per-in-flight 1"
  [ -n "$ONE_POINT" ] && ONE="${RUNNER[*]} run ${SERVERS[*]} --systems $ONE_SYSTEMS --points $ONE_POINT --prompts-per-in-flight 16 --settle-prompts-per-in-flight 4"
  setsid nohup bash -c "${RUNNER[*]} run ${SERVERS[*]} --systems $PHASE_SYSTEMS --phases $PHASES; a=\$?; $LONG; b=\$?; $MATRIX; c=\$?; $ONE; echo \$a \$b \$c \$? > $DIR/bench.rc" \
    >> $DIR/bench.out 2>&1 < /dev/null &
  echo $! > $DIR/bench.pid
  log "bench started (pid $(cat $DIR/bench.pid)): phases $PHASES, then $LONG_POINTS, then $POINTS, then $ONE_POINT"
  ;;
status)
  status
  ;;
wait)
  LIMIT=${2:-540}
  while running && [ $(($(date +%s) - T0)) -lt "$LIMIT" ]; do
    sleep 20
    log "$(grep -E '^\[[0-9]+/[0-9]+\]|^  .* phase ' $DIR/bench.out 2>/dev/null | tail -1)"
  done
  status
  running && exit 1
  exit 0
  ;;
pack)
  # the servers' start (vLLM's config lines: what a colocated server and a flexible worker run differently), which the logs' tails lose
  for f in $DIR/logs/colocated0.log $DIR/logs/flex0.log; do [ -f $f ] && head -c 300000 $f > ${f%.log}-start.txt; done
  "${RUNNER[@]}" report "${SERVERS[@]}" --systems $PHASE_SYSTEMS --phases $PHASES > $DIR/report.txt 2>&1
  cat $DIR/report.txt
  "${RUNNER[@]}" pack "${SERVERS[@]}" --systems $PHASE_SYSTEMS --to "${OUT:?set OUT (the device call sets it)}/results.tar.gz"
  ;;
down)
  running && kill -TERM -- -"$(cat $DIR/bench.pid)"
  "${RUNNER[@]}" down "${SERVERS[@]}" --systems $PHASE_SYSTEMS
  status
  ;;
*)
  echo "usage: $0 start | bench | status | wait [SECONDS] | pack | down" >&2
  exit 2
  ;;
esac
