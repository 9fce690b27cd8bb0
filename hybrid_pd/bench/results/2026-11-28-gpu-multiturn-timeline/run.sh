#!/bin/bash
# Issue #35, part 3: where a P/D turn's time goes in the multi-turn run of docs/performance.md (two GPUs, vLLM 0.26 from
# ../shared/gpu), whose P/D turns reached their first token 200-300 ms later than the simulator predicts. Nemotron-H-8B at
# its published size, prefix caching on, the multi-turn run's settings (--max-num-seqs 128 --gpu-memory-utilization 0.45
# --kv-cache-memory-bytes 8GiB --max-model-len 4096); two P/D pairs, prefill on GPU 0 and decode on GPU 1:
#   ded:  a prefill and a decode worker, both recording the hand-off timeline (--timeline-dir), as its router does;
#   flex: two flexible workers (what the multi-turn run measured as "pd"), the router's spans only.
# Each pair behind its own prefix_reuse router. Runs (32 conversations of 4 turns, 2,000-token system prompts, user
# messages of 100-300 tokens, 100-token answers): each pair at 8 conversations at once, with prefix hits and salted (no
# hit), then the dedicated pair at 1 at once; every server's /metrics read before and after each run (run1/).
# Run 2 (run2-prefill-sync/): SERVERS, PAIRS, RUNS and PROBE=1 as in docs/performance.md ("Multi-turn chat: where a P/D
# turn's time goes"): a second prefill worker with --no-async-scheduling, both prefill workers feeding the same decode worker.
# Run 3 (run3-single-turn/): the synchronous prefill on single-turn traffic with vLLM's client, prefix caching off, against
# the asynchronous prefill behind the same decode worker, two colocated replicas on the same GPUs (the project's standing
# check) and a colocated server alone at 1 in flight (issue #35's TTFT target); a second decode worker with vLLM's own
# detokenizer priming (--skip-engine-fix detok_suffix) behind the synchronous prefill, the detok_suffix cut side by side:
#   set -a; source hybrid_pd/bench/results/2026-11-28-gpu-multiturn-timeline/run3.env; set +a; bash .../run.sh start
# Device time with the kit (lease figures): run 1 ~465 s, run 2 ~460 s (../2026-11-28-gpu-prefix-hit-cost between them ~535 s),
# run 3 ~700 s (servers ready in 205 s, the 14 points in ~460 s; its first start lost ~520 s to servers dead of max_model_len).
# Run 4 (run4.env: the detok_suffix cut, one GPU, with the plugin loading) is prepared, not run.
# Run 5 (run5.env, two GPUs): the idle-engine cuts of the hand-off (a decode worker as shipped against one with
# --pull-await-us=0 --skip-engine-fix=idle_poll, fed by the same prefill) at 1 in flight and at 1000/512 @ 64, each twice
# (ABBA), and two colocated servers on GPU 0 with and without detok_suffix; it replaces run 4. As run, a server's name
# won over a pair's: the points of target "new" went to the decode worker's own server (whole requests), void; "newb"
# reached the pair. Fixed since (a pair's name wins); results in run5-idle-cuts/, ~880 s of device time with the kit.
# Run 6 (run6.env, two GPUs): the split as shipped after the cuts against two colocated replicas on the same GPUs, ABBA
# at 1000/512 @ 64, and the TTFT target at 1 in flight against a colocated server on each GPU, twice.
# Run 7 (run7.env, ONE GPU): the TTFT target at 1 in flight with P/D and the colocated server on the same GPU, and the
# decode worker as shipped against one without the idle-engine cuts, fed by the same prefill worker, each early and late.
# Run 8 (run8.env, ONE GPU): run 7's layout without the second decode worker, PROBE=1; after the runs, on the GPU machine:
#   python3 ../2026-11-27-h100-handoff-probe/analyze.py $DIR/probe $DIR/timeline; per_call.py $DIR/probe (run8-probe/).
# Run 9 (run9.env, ONE GPU): run 8's layout without the probe, after detok_suffix's fix of prompts ending in U+FFFD
#   (run9-unrepeated/; run as one call after the kit's calls 1-2: run.sh start, then run.sh pack).
# Run 10 (run10.env, ONE GPU): what costs the decode worker its +3-4% TPOT at 1 in flight against the colocated server
#   (runs 7-9): whole requests (no split) on decode workers as shipped, with the attention KV cache in NHD instead of the
#   HND vLLM's NIXL connector sets, and without idle_poll, against colocated servers in NHD and HND (run10-tpot/).
#   A server's extra flags may set its environment: env:NAME=VALUE.
# Run 12 (run12.env, ONE GPU): the early leg held in vLLM's scheduler, its push taken by the decode engine itself
#   (--early-leg-hold scheduler), against the decode worker as shipped and a colocated server, 1 in flight at 1,000 and
#   8,000 prompt tokens, then 1000/512 @ 64 ABBA (run12-scheduler-hold/).
# Run 13 (run13.env, ONE GPU): run 12's load points again, each pair warmed at 64 in flight first (run13-scheduler-load/).
# Run 14 (run14.env, ONE GPU): run 13 after the scheduler hold reads its inbox once a step (run14-scheduler-step/).
# Run 15 (run15.env, ONE GPU): the TTFT target at 1 in flight after that cut, two rounds at 1,000 tokens (run15-ttft/).
# Run 16 (run16.env, ONE GPU): run 15's second round at 1,000 tokens and a round at 8,000 (run16-ttft/).
# Run 17 (run17.env, TWO GPUs, prepared, not run: nvidia-h200-x2 not lent): the standing check for --early-leg-hold scheduler.
# Run 18 (run18.env, ONE GPU): the hand-off with and without vLLM's asynchronous scheduling on the decode engine. Its one
#   try (2026-11-29, 480 s of device time with the kit) measured nothing: the three servers were ready at 349 s and the
#   call's `timeout 380 run.sh start` (set to fit the device time left) ended before the first point did. Give it ~600 s.
# Calls (the machine goes cold ~30 s after a call: never leave a gap):
#   call 3: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash hybrid_pd/bench/results/2026-11-28-gpu-multiturn-timeline/run.sh start
#   call 4: bash /tmp/site/.gpu-payload/unpack.sh --all >/dev/null || exit; source /tmp/site/.gpu-payload/env.sh; bash hybrid_pd/bench/results/2026-11-28-gpu-multiturn-timeline/run.sh wait 500; bash hybrid_pd/bench/results/2026-11-28-gpu-multiturn-timeline/run.sh pack
set -u
STAGE=${1:-status}
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${DIR:-/tmp/mt-timeline}
M=${MODEL:-/tmp/full/nemotron_h}
NAME=nemotron-h-8b
DEVICE=${DEVICE:-cuda} SYSTEM_TOKENS=${SYSTEM_TOKENS:-2000}  # DEVICE=cpu MODEL=<tiny model dir> SERVERS=... RUNS=...: a smoke run of this script on CPU
RUNS=${RUNS-"ded:8:32: flex:8:32: ded:8:32:salted flex:8:32:salted ded:1:8: ded:16:32: flex:16:32: dedb:8:32:"}  # pair:at once:conversations:salted
BENCH=${BENCH:-}  # after RUNS, vllm bench serve: target:input len:output len:at once:prompts, target a pair or replicas (its router) or a server
REPLICAS=${REPLICAS:-}  # name:port:server port,server port...: a router over colocated servers, whole requests (a BENCH target)
export PYTHONPATH=$PWD:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1 UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
if [ -n "${PROBE:-}" ]; then  # PROBE=1: every process times vLLM's scheduler and model runner per call (../2026-11-27-h100-handoff-probe)
  export PYTHONPATH=$HERE/../2026-11-27-h100-handoff-probe/probe:$PYTHONPATH HANDOFF_PROBE_DIR=$DIR/probe
  mkdir -p $DIR/probe
fi
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
CACHING=${CACHING:-on}  # CACHING=off: every server with prefix caching off (single-turn traffic, BENCH)
COMMON=(--model $M --served-model-name $NAME --device $DEVICE --max-model-len ${MAX_MODEL_LEN:-4096} --max-num-seqs 128)
[ $CACHING = on ] && COMMON+=(--vllm-arg=--enable-prefix-caching) || COMMON+=(--vllm-arg=--no-enable-prefix-caching)
[ $DEVICE = cuda ] && COMMON+=(--gpu-memory-utilization ${GPU_MEM:-0.45} --kv-cache-memory-bytes $((${KV_GIB:-8} << 30)))
# name role gpu port side-channel-port extra...
SERVERS=${SERVERS:-"pre:prefill:0:8100:5600 dec:decode:1:8101:5601 flex0:flex:0:8102:5602 flex1:flex:1:8103:5603"}  # name:role:gpu:port:side channel[:extra flags, comma-separated]
PAIRS=${PAIRS:-"ded:8110:8100:8101 flex:8111:8102:8103"}  # router name:port:prefill port:decode port
serve() {  # name role gpu port side-channel-port [flag | env:NAME=VALUE]...
  local name=$1 role=$2 gpu=$3 port=$4 sc=$5 a envs=() flags=(); shift 5
  for a in "$@"; do [[ $a == env:* ]] && envs+=("${a#env:}") || flags+=("$a"); done
  env "${envs[@]}" CUDA_VISIBLE_DEVICES=$gpu setsid python3 -m hybrid_pd.cli $role "${COMMON[@]}" --port $port --side-channel-port $sc "${flags[@]}" \
    > $DIR/logs/$name.log 2>&1 < /dev/null &
  echo $! > $DIR/pid-$name
}
ready() {
  for p in "$@"; do
    until curl -sf 127.0.0.1:$p/health > /dev/null; do
      [ $(($(date +%s) - T0)) -gt 480 ] && { log "port $p not ready"; return 1; }
      for f in $DIR/pid-*; do kill -0 "$(cat $f)" 2>/dev/null || { log "${f##*/pid-} exited"; return 1; }; done  # not 8 minutes for a dead one
      sleep 3
    done
  done
}
snapshot() { # run when
  local s server port
  for s in $SERVERS; do IFS=: read -r server _ _ port _ <<< "$s"; curl -s 127.0.0.1:$port/metrics > $DIR/metrics/$1-$2-$server.txt; done
}
measure() { # the runs, one after the other (detached)
  local granule run pair level convs salted
  granule=$(grep -ho "Setting attention block size to [0-9]* tokens" $DIR/logs/pre.log | tail -1 | grep -o "[0-9]*" | head -1)
  for run in $RUNS; do
    IFS=: read -r pair level convs salted <<< "$run"
    local tag="$pair-c$level" p name rport pport dport
    for p in $PAIRS; do IFS=: read -r name rport pport dport <<< "$p"; [ "$name" = "${pair%b}" ] && break; done  # dedb: ded again, fresh tokens
    local url=http://127.0.0.1:$rport metrics=(--metrics prefill=http://127.0.0.1:$pport --metrics decode=http://127.0.0.1:$dport)
    local name=$tag${salted:+-salted}
    snapshot $name before
    python3 -m hybrid_pd.bench.multiturn --url $url --model $NAME --conversations $convs --turns 4 --system-tokens $SYSTEM_TOKENS \
      --user-tokens 100-300 --output-tokens 100 --vocab 512 --concurrency $level --gpus 2 --granule ${granule:-1152} \
      --tag $tag ${salted:+--cache-salt} "${metrics[@]}" --out $DIR/mt/$name.json > $DIR/mt/$name.log 2>&1
    log "$name rc $? $(tail -1 $DIR/mt/$name.log)"
    snapshot $name after
  done
  local b target in out conc num port s file
  for b in $BENCH; do  # vLLM's own client; the same seed for every target of a point: the same prompts
    IFS=: read -r target in out conc num <<< "$b"
    port=
    for s in $SERVERS; do IFS=: read -r name _ _ rport _ <<< "$s"; [ "$name" = "$target" ] || [ "$name" = "${target%b}" ] && port=$rport; done  # colb: col again
    for p in $PAIRS $REPLICAS; do IFS=: read -r name rport _ <<< "$p"; [ "$name" = "${target%b}" ] && port=$rport; done  # a pair's name wins over a server's
    file=$target-$in-$out-c$conc
    snapshot bench-$file before
    python3 $HERE/vllm_bench.py --backend openai --base-url http://127.0.0.1:$port --endpoint /v1/completions \
      --model $NAME --tokenizer $M --dataset-name random --random-input-len $in --random-output-len $out --ignore-eos \
      --max-concurrency $conc --num-prompts $num --seed $((in + out + conc)) --goodput ttft:500 tpot:20 \
      --percentile-metrics ttft,tpot,itl,e2el --request-id-prefix $file- --save-result --result-dir $DIR/bench --result-filename $file.json \
      > $DIR/bench/$file.log 2>&1  # the id prefix: the routers' timelines group each point's requests
    log "bench $file rc $? $(grep -E 'Request throughput|Median TTFT|Mean TPOT' $DIR/bench/$file.log | tr -s ' ' | tr '\n' ';')"
    snapshot bench-$file after
  done
}
running() { [ -f $DIR/measure.pid ] && kill -0 "$(cat $DIR/measure.pid)" 2>/dev/null; }
case $STAGE in
start)
  mkdir -p $DIR/logs $DIR/metrics $DIR/mt $DIR/timeline $DIR/bench
  nvidia-smi -L > $DIR/gpus.txt
  python3 -c "import vllm, torch, nixl; print('vllm', vllm.__version__, 'torch', torch.__version__)" > $DIR/versions.txt 2>&1
  git -C $PWD rev-parse HEAD > $DIR/commit.txt 2>/dev/null
  if [ $DEVICE = cuda ] && [ ! -f $M/config.json ]; then
    python3 -m hybrid_pd.models.families /tmp/full --full nemotron_h > $DIR/build.log 2>&1 || { log "build failed"; tail -20 $DIR/build.log; exit 1; }
  fi
  log "model ready"
  for s in $SERVERS; do
    IFS=: read -r name role gpu port sc flag <<< "$s"
    extra=(${flag//,/ })  # the extra flags, comma-separated
    [ $role = prefill ] || [ $role = decode ] && extra+=(--timeline-dir $DIR/timeline)
    serve $name $role $gpu $port $sc "${extra[@]}"
  done
  ready $(for s in $SERVERS; do echo $s | cut -d: -f4; done) || { tail -n 30 $DIR/logs/*.log; exit 1; }
  log "servers ready"
  routers=()
  for p in $PAIRS; do  # a prefix_reuse router per pair of servers started
    IFS=: read -r name rport pport dport <<< "$p"
    ports=" $(for s in $SERVERS; do echo -n "$(echo $s | cut -d: -f4) "; done)"
    [[ $ports == *" $pport "* && $ports == *" $dport "* ]] || continue
    setsid python3 -m hybrid_pd.cli router --port $rport --prefill http://127.0.0.1:$pport --decode http://127.0.0.1:$dport \
      --decode-policy prefix_reuse --prefill-policy prefix_reuse --timeline-dir $DIR/timeline > $DIR/logs/router-$name.log 2>&1 < /dev/null &
    echo $! > $DIR/pid-router-$name; routers+=($rport)
  done
  for r in $REPLICAS; do  # a router over colocated servers: every request whole on one of them
    IFS=: read -r name rport ports <<< "$r"
    setsid python3 -m hybrid_pd.cli router --port $rport $(for p in ${ports//,/ }; do echo --decode http://127.0.0.1:$p; done) \
      > $DIR/logs/router-$name.log 2>&1 < /dev/null &
    echo $! > $DIR/pid-router-$name; routers+=($rport)
  done
  ready "${routers[@]}" || exit 1
  for port in "${routers[@]}"; do  # the first conversations after start compile and capture: not measured
    url=http://127.0.0.1:$port
    python3 -m hybrid_pd.bench.multiturn --url $url --model $NAME --conversations 2 --turns 2 --system-tokens $SYSTEM_TOKENS \
      --user-tokens 100-300 --output-tokens 100 --vocab 512 --concurrency 2 --tag warmup$port --seed 99 >> $DIR/warmup.log 2>&1
  done
  log "warm: $(grep -c requests $DIR/warmup.log) runs"
  export -f measure snapshot log; export DIR RUNS BENCH SERVERS PAIRS REPLICAS NAME T0 SYSTEM_TOKENS M HERE
  setsid nohup bash -c measure >> $DIR/measure.out 2>&1 < /dev/null &
  echo $! > $DIR/measure.pid
  bash "$0" wait $((520 - ($(date +%s) - T0)))
  ;;
runs)  # the runs again on the servers started (RUNS=... with tags not used yet: a tag's tokens are in the caches)
  measure
  ;;
wait)
  while running && [ $(($(date +%s) - T0)) -lt "${2:-540}" ]; do sleep 10; done
  cat $DIR/measure.out
  running && { log "still running"; exit 1; }
  log "runs ended"
  ;;
pack)
  running && kill -TERM -- -"$(cat $DIR/measure.pid)"
  for f in $DIR/pid-*; do kill -TERM -- -"$(cat $f)" 2>/dev/null; done
  python3 $HERE/analyze.py $DIR --json $DIR/analysis.json > $DIR/analysis.txt 2>&1; tail -c 6000 $DIR/analysis.txt
  tar -C $(dirname $DIR) -czf "${OUT:?set OUT (the device call sets it)}/results.tar.gz" $(basename $DIR)
  ls -la $OUT
  ;;
*)
  echo "usage: $0 start | runs | wait [SECONDS] | pack" >&2
  exit 2
  ;;
esac
