#!/bin/bash
# The four-GPU run of issue 34 (4x H100 80GB, vLLM 0.26 from ../shared/gpu): Nemotron-H-8B at its published size,
# one set of servers (a colocated server and a flexible worker per GPU), and against them, systems replicas, 1P3D,
# 3P1D and planner (the router's planner over the four flexible workers, from the H100 profile):
#   - the matrix 1000/512 @ 64 and @ 128 (SLO 500/20), 16000/256 @ 32 and 32000/128 @ 16 (SLO 4000/15),
#     2 prompts per request in flight, each system behind a router of its own per point; the planner's router first
#     gets 1 prompt per request in flight of the same traffic to settle on (unmeasured, kept as the row's "settle");
#   - phase-shifting traffic, back to back through one router per system: 1000/512 @ 64 -> 16000/256 @ 32 ->
#     1000/512 @ 64, each phase judged at its SLO (the planner's router serves to 4000/15 throughout: under it the chat's
#     best layout is whole requests and the documents' 3P1D, as under each phase's own);
#     PHASE_CHAT and PHASE_DOCS prompts (400, 128): ~25-40 s a phase at the replicas' rates of the first 2026-11-27
#     run, up to ~65 s for the slowest split; 60-90 s phases would take ~5 more minutes than the budget has.
# Device time, estimated from the 2026-11-27 run: kit calls ~2.5 min, model build + 8 servers ~5 min, warm-up ~0.5 min,
# matrix ~10 min (4 systems x 4 points, router starts, the planner's settling), phases ~7 min, pack ~0.5 min: ~25 min.
# Run from the checkout's root on the GPU machine, the kit's third call and the calls right after it (the machine goes
# cold ~30 s after a call: never leave a gap):
#   call 3: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100x4-planner/run.sh start
#   call 4: bash /tmp/site/.gpu-payload/unpack.sh --all || exit; source /tmp/site/.gpu-payload/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100x4-planner/run.sh wait 560
#   call 5: (same prefix) bash hybrid_pd/bench/results/2026-11-27-h100x4-planner/run.sh wait 540; bash hybrid_pd/bench/results/2026-11-27-h100x4-planner/run.sh pack
# Stages:
#   start          build the model (max position 65536) unless built, the planner's profile (cache_bytes 14 GiB), the
#                  eight servers (returns once all answer, ~4-5 min), then `bench` detached
#   bench          the matrix, then the phases: one `goodput run`, detached (setsid nohup), output in $DIR/bench.out
#   status         servers, whether the bench runs, runs done of all, the last lines of its output
#   wait [S]       status every 30 s until the bench ends or S seconds (default 540) pass; exit 0 once it ended
#   pack           the tables so far ($DIR/report.txt) and one archive of the results: $OUT/results.tar.gz
#   down           stop the bench and the servers
set -u
STAGE=${1:-status}
DIR=${DIR:-/tmp/h100x4-planner}
MODEL=/tmp/full/nemotron_h
PROFILE=$DIR/planner-profile.json
SOURCE_PROFILE=hybrid_pd/bench/results/2026-11-25-h100x2-sizing/profile.json
PHASE_CHAT=${PHASE_CHAT:-400} PHASE_DOCS=${PHASE_DOCS:-128}
export PYTHONPATH=$PWD:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
# The servers' settings of the 2026-11-27 run (issue 34) and the systems, the same for every stage (`up` checks them).
COMMON=(--out $DIR --model $MODEL --device cuda --gpus 4 --max-model-len 33280 --kv-cache-gib 14 --gpu-memory-utilization 0.47
        --max-num-seqs 128 --systems replicas,1P3D,3P1D,planner --slo 500/20 --slo 1500/50)
POINTS=1000/512@64:500/20,1000/512@128:500/20,16000/256@32:4000/15,32000/128@16:4000/15
PHASES=1000/512@64x$PHASE_CHAT:500/20,16000/256@32x$PHASE_DOCS:4000/15,1000/512@64x$PHASE_CHAT:500/20
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
    grep -E '^\[[0-9]+/[0-9]+\]' $DIR/bench.out | tail -1 | sed 's/^/last run: /'
    grep -E '^\[[0-9]+/[0-9]+\]|^  .* phase |Error|Traceback|FAILED' $DIR/bench.out | tail -4
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
  "${RUNNER[@]}" up "${COMMON[@]}" >> $DIR/up.log 2>&1 || { log "servers did not start"; tail -20 $DIR/up.log $DIR/serve.log; exit 1; }
  log "$(tail -1 $DIR/up.log)"
  bash "$0" bench
  ;;
bench)
  running && { log "the bench runs already (pid $(cat $DIR/bench.pid))"; exit 1; }
  rm -f $DIR/bench.rc
  setsid nohup bash -c "${RUNNER[*]} run ${COMMON[*]} --planner-profile $PROFILE --points $POINTS --prompts-per-in-flight 2 --settle-prompts-per-in-flight 1 --phases $PHASES --phases-router-slo 4000/15; echo \$? > $DIR/bench.rc" \
    >> $DIR/bench.out 2>&1 < /dev/null &
  echo $! > $DIR/bench.pid
  log "bench started (pid $(cat $DIR/bench.pid)): matrix $POINTS, phases $PHASES"
  ;;
status)
  status
  ;;
wait)
  LIMIT=${2:-540}
  while running && [ $(($(date +%s) - T0)) -lt "$LIMIT" ]; do
    sleep 30
    log "$(grep -E '^\[[0-9]+/[0-9]+\]' $DIR/bench.out 2>/dev/null | tail -1)"
  done
  status
  running && exit 1
  exit 0
  ;;
pack)
  "${RUNNER[@]}" report "${COMMON[@]}" --planner-profile $PROFILE --phases $PHASES > $DIR/report.txt 2>&1
  cat $DIR/report.txt
  "${RUNNER[@]}" pack "${COMMON[@]}" --to "${OUT:?set OUT (the device call sets it)}/results.tar.gz"
  ;;
down)
  running && kill -TERM -- -"$(cat $DIR/bench.pid)"
  "${RUNNER[@]}" down "${COMMON[@]}"
  status
  ;;
*)
  echo "usage: $0 start | bench | status | wait [SECONDS] | pack | down" >&2
  exit 2
  ;;
esac
