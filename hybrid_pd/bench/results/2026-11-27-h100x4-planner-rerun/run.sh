#!/bin/bash
# The four-GPU run of issue 34, third: the second (../2026-11-27-h100x4-planner-slo) again after its fixes (the split's
# bounds in counted tokens, a sampled prompt counted, a change of load a shift), with the matrix's two long-prompt points
# added. 4x H100 80GB or H200, vLLM 0.26 from ../shared/gpu: Nemotron-H-8B at its published size, one set of servers (a
# colocated server and a flexible worker per GPU), the planner's profile unchanged, and against them:
#   1. phase-shifting traffic, back to back through one router per system (replicas, 1P3D, 2P2D, planner):
#      chat 1000/512 @ 128 in flight asking 500/20 ms (1P3D best in the first run) -> documents 16000/256 @ 32 asking
#      4000/15 (3P1D best) -> chat again; every request names its phase's SLO in x-slo-ttft-ms / x-slo-tpot-ms, which the
#      planner sizes for; each phase judged at its own. 768 chat and 256 document prompts: ~35-45 s a phase under its best
#      layout (the first run's rates), up to ~115 s for the documents under 1P3D.
#      Simulated first (CPU, the four-H100 refit profile):
#        hybrid-pd size --profile ../2026-11-27-sim-refit/h100x4-profile.json --gpus 4 --slo-ttft-ms 500 --slo-tpot-ms 20 \
#          --phases 1000/512@128x768:500/20,16000/256@32x256:4000/15,1000/512@128x768:500/20
#   2. then the matrix points where the planner must not split and must split, 1000/512 @ 64 and @ 128 under 500/20
#      (replicas, 1P3D, planner; the planner's router first settles on 1 prompt per request in flight, unmeasured),
#   3. and the long prompts, 16000/256 @ 32 and 32000/128 @ 16 under 4000/15 (replicas, 3P1D, planner: 3P1D was the best
#      fixed layout there in the first run and the second),
#   4. and one request at a time, 1000/64 @ 1, 16 prompts (replicas, 1P3D, planner): the TTFT a split adds (issue 35's
#      hand-off) and the planner's, which should keep whole requests there (issue 34: <= replicas + 5 ms).
# Device time, estimated from the 2026-11-27 run: kit calls ~2.5 min, model build + 8 servers ~5 min, warm-up ~1 min,
# phases ~10 min, matrix ~2 + ~2.5 + ~0.5 min, pack ~0.5 min: ~23 min.
# Run from the checkout's root on the GPU machine, the kit's third call and the calls right after it (the machine goes
# cold ~30 s after a call: never leave a gap):
#   call 3: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100x4-planner-rerun/run.sh start
#   call 4: bash /tmp/site/.gpu-payload/unpack.sh --all >/dev/null || exit; source /tmp/site/.gpu-payload/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100x4-planner-rerun/run.sh wait 570
#   call 5: (same prefix) bash hybrid_pd/bench/results/2026-11-27-h100x4-planner-rerun/run.sh wait 520; bash hybrid_pd/bench/results/2026-11-27-h100x4-planner-rerun/run.sh pack
# Stages:
#   start          build the model (max position 65536) unless built, the planner's profile (cache_bytes 14 GiB), the
#                  eight servers (returns once all answer, ~4-5 min), then `bench` detached
#   bench          the phases, then the matrix points: two `goodput run`s, detached (setsid nohup), output in $DIR/bench.out
#   status         servers, whether the bench runs, the last lines of its output
#   wait [S]       status every 20 s until the bench ends or S seconds (default 540) pass; exit 0 once it ended
#   pack           the tables so far ($DIR/report.txt) and one archive of the results: $OUT/results.tar.gz
#   down           stop the bench and the servers
set -u
STAGE=${1:-status}
DIR=${DIR:-/tmp/h100x4-planner-rerun}
MODEL=/tmp/full/nemotron_h
PROFILE=$DIR/planner-profile.json
SOURCE_PROFILE=hybrid_pd/bench/results/2026-11-25-h100x2-sizing/profile.json  # the router's profile in the first run too
export PYTHONPATH=$PWD:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
SERVERS=(--out $DIR --model $MODEL --device cuda --gpus 4 --max-model-len 33280 --kv-cache-gib 14 --gpu-memory-utilization 0.47
         --max-num-seqs 128 --slo 500/20 --slo 1500/50 --planner-profile $PROFILE)
# PHASE_SYSTEMS, POINTS, LONG_POINTS and ONE_POINT may be cut to fit the device time left (POINTS= : no matrix); the run's record says which ran
# 3P1D left out of the phases for device time (two tries for four GPUs cost 180 s): it served 0.22x the replicas over the
# second run's phases (0.06x in each chat phase); the long-prompt points measure it where it is best
PHASE_SYSTEMS=${PHASE_SYSTEMS:-replicas,1P3D,2P2D,planner}
MATRIX_SYSTEMS=replicas,1P3D,planner
PHASES=1000/512@128x768:500/20,16000/256@32x256:4000/15,1000/512@128x768:500/20
POINTS=${POINTS-1000/512@64:500/20,1000/512@128:500/20}
LONG_SYSTEMS=replicas,3P1D,planner
LONG_POINTS=${LONG_POINTS-16000/256@32:4000/15,32000/128@16:4000/15}
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
  python3 -c "import json; p = json.load(open('$SOURCE_PROFILE')); p['cache_bytes'] = 14 << 30; json.dump(p, open('$PROFILE', 'w'), indent=1)"
  "${RUNNER[@]}" up "${SERVERS[@]}" --systems $PHASE_SYSTEMS >> $DIR/up.log 2>&1 || { log "servers did not start"; tail -20 $DIR/up.log $DIR/serve.log; exit 1; }
  log "$(tail -1 $DIR/up.log)"
  bash "$0" bench
  ;;
bench)
  running && { log "the bench runs already (pid $(cat $DIR/bench.pid))"; exit 1; }
  rm -f $DIR/bench.rc
  MATRIX="true" LONG="true" ONE="true"
  [ -n "$POINTS" ] && MATRIX="${RUNNER[*]} run ${SERVERS[*]} --systems $MATRIX_SYSTEMS --points $POINTS --prompts-per-in-flight 2 --settle-prompts-per-in-flight 1"
  [ -n "$LONG_POINTS" ] && LONG="${RUNNER[*]} run ${SERVERS[*]} --systems $LONG_SYSTEMS --points $LONG_POINTS --prompts-per-in-flight 2 --settle-prompts-per-in-flight 1"
  [ -n "$ONE_POINT" ] && ONE="${RUNNER[*]} run ${SERVERS[*]} --systems $MATRIX_SYSTEMS --points $ONE_POINT --prompts-per-in-flight 16 --settle-prompts-per-in-flight 4"
  setsid nohup bash -c "${RUNNER[*]} run ${SERVERS[*]} --systems $PHASE_SYSTEMS --phases $PHASES; a=\$?; $MATRIX; b=\$?; $LONG; c=\$?; $ONE; echo \$a \$b \$c \$? > $DIR/bench.rc" \
    >> $DIR/bench.out 2>&1 < /dev/null &
  echo $! > $DIR/bench.pid
  log "bench started (pid $(cat $DIR/bench.pid)): phases $PHASES, then matrix $POINTS, then $LONG_POINTS, then $ONE_POINT"
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
