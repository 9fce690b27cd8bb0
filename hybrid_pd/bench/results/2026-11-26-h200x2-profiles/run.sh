#!/bin/bash
# Device runs of 2026-11-26 (two GPUs): hybrid-pd profile of Nemotron-H-8B on the device, prefix caching
# off and on, a TP-2 profile, and vllm bench serve against one GPU with caching off and on.
# usage: bash gpu-run.sh A|B   (A: TP-1 profiles + benches; B: TP-2 profile)   results under $OUT
set -u
STAGE=$1
T0=$(date +%s)
BUDGET=${BUDGET:-540}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
export PYTHONPATH=$PWD:/tmp/site UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
M=/tmp/full/nemotron_h
DEV="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
COMMON=(--model $M --served-model-name nemotron-h-8b --device cuda --max-model-len 4096 --max-num-seqs 128
        --gpu-memory-utilization 0.45 --kv-cache-memory-bytes 8589934592)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
serve() { # name gpus port role extra...
  local name=$1 gpus=$2 port=$3 role=$4; shift 4
  CUDA_VISIBLE_DEVICES=$gpus setsid python3 -m hybrid_pd.cli $role "${COMMON[@]}" --port $port "$@" > $OUT/$name.log 2>&1 &
  echo $! > /tmp/pid-$name
}
ready() { # port... : wait for /health of each, within the budget
  for p in "$@"; do
    until curl -sf 127.0.0.1:$p/health > /dev/null; do
      [ "$(left)" -lt 30 ] && { log "port $p not ready"; return 1; }
      sleep 3
    done
  done
}
block_of() { grep -o "attention block size to [0-9]*" "$1" | grep -o "[0-9]*$" | head -1; }
profile() { # name url tp extra...
  local name=$1 url=$2 tp=$3; shift 3
  python3 -m hybrid_pd.cli profile --url $url --out $OUT/profile-$name.json --measurements-json $OUT/measured-$name.json \
    --max-num-seqs 128 --max-num-batched-tokens 8192 --tensor-parallel-size $tp --device "$DEV" "$@" > $OUT/profile-$name.log 2>&1
  log "profile $name rc $?"
}
bench() { # name port in out seed
  python3 -m vllm.entrypoints.cli.main bench serve --backend openai --base-url http://127.0.0.1:$2 --endpoint /v1/completions \
    --model nemotron-h-8b --tokenizer $M --dataset-name random --random-input-len $3 --random-output-len $4 --ignore-eos \
    --max-concurrency 32 --num-prompts 64 --seed $5 --goodput ttft:500 tpot:20 --percentile-metrics ttft,tpot,itl,e2el \
    --save-result --save-detailed --result-dir $OUT/bench --result-filename $1-$3-$4.json > $OUT/bench-$1-$3-$4.log 2>&1
  log "bench $1 $3/$4 rc $?"
}
stop_all() { for f in /tmp/pid-*; do [ -f "$f" ] && kill -TERM -- -"$(cat $f)" 2>/dev/null; rm -f "$f"; done; sleep 5; pkill -9 -f "vllm|hybrid_pd" 2>/dev/null; true; }

nvidia-smi -L > $OUT/gpus.txt
python3 -c "import vllm, torch, nixl; print('vllm', vllm.__version__, 'torch', torch.__version__)" > $OUT/versions.txt 2>&1
if [ ! -f $M/config.json ]; then
  python3 -m hybrid_pd.models.families /tmp/full --full nemotron_h > $OUT/build.log 2>&1 || { log "build failed"; exit 1; }
fi
log "model ready"

if [ "$STAGE" = A ]; then
  if ! curl -sf 127.0.0.1:8110/health > /dev/null; then  # servers of an earlier call on this machine are reused
  serve off 0 8100 colocated
  serve on 1 8101 colocated --vllm-arg=--enable-prefix-caching
  serve flexp 0 8102 flex --side-channel-port 5600
  serve flexd 1 8103 flex --side-channel-port 5601
  ready 8100 8101 8102 8103 || { stop_all; exit 1; }
  log "servers ready"
  setsid python3 -m hybrid_pd.cli router --port 8110 --local-prefill-below-tokens 0 --prefill http://127.0.0.1:8102 --decode http://127.0.0.1:8103 > $OUT/router.log 2>&1 &
  echo $! > /tmp/pid-router
  ready 8110
  fi
  python3 -c "from hybrid_pd.router.health import wait_routed as w; import sys; sys.exit(0 if w('http://127.0.0.1:8110', {'http://127.0.0.1:8102', 'http://127.0.0.1:8103'}, 60, lambda: True) else 1)" || log "router does not route to both"
  grep -h "attention block size" $OUT/*.log | sort | uniq -c > $OUT/blocks.txt || true
  profile on http://127.0.0.1:8101 1 --block-tokens ${BT_ON:-$(block_of $OUT/on.log)} & P1=$!
  profile off http://127.0.0.1:8100 1 --block-tokens ${BT_OFF:-$(block_of $OUT/off.log)} \
    --transfer-router http://127.0.0.1:8110 --transfer-metrics http://127.0.0.1:8103
  wait $P1
  if [ "$(left)" -gt 110 ]; then
    bench off 8100 1000 512 11 & P1=$!; bench on 8101 1000 512 11; wait $P1
  fi
  if [ "$(left)" -gt 60 ]; then
    bench off 8100 1000 64 12 & P1=$!; bench on 8101 1000 64 12; wait $P1
  fi
  stop_all
elif [ "$STAGE" = C ]; then  # the caching-on profile again (Mamba cache mode read from the server), benches again
  serve off 0 8100 colocated
  serve on 1 8101 colocated --vllm-arg=--enable-prefix-caching
  serve flexp 0 8102 flex --side-channel-port 5600
  serve flexd 1 8103 flex --side-channel-port 5601
  ready 8100 8101 8102 8103 || { stop_all; exit 1; }
  log "servers ready"
  setsid python3 -m hybrid_pd.cli router --port 8110 --local-prefill-below-tokens 0 --prefill http://127.0.0.1:8102 --decode http://127.0.0.1:8103 > $OUT/router.log 2>&1 &
  echo $! > /tmp/pid-router
  ready 8110
  python3 -c "from hybrid_pd.router.health import wait_routed as w; import sys; sys.exit(0 if w('http://127.0.0.1:8110', {'http://127.0.0.1:8102', 'http://127.0.0.1:8103'}, 60, lambda: True) else 1)" || log "router does not route to both"
  grep -h "attention block size\|KV cache size\|Maximum concurrency\|Mamba cache mode" $OUT/*.log | sort | uniq -c > $OUT/blocks.txt
  profile on http://127.0.0.1:8101 1
  tail -3 $OUT/profile-on.log
  profile off http://127.0.0.1:8100 1 --transfer-router http://127.0.0.1:8110 --transfer-metrics http://127.0.0.1:8103
  tail -3 $OUT/profile-off.log
  [ -n "${NO_BENCH:-}" ] || { bench off 8100 1000 512 21 & P1=$!; bench on 8101 1000 512 21; wait $P1; }
  [ -n "${NO_BENCH:-}" ] || { bench off 8100 1000 64 22 & P1=$!; bench on 8101 1000 64 22; wait $P1; }
  stop_all
else
  serve tp2 0,1 8100 colocated --tensor-parallel-size 2
  serve on 1 8101 colocated --vllm-arg=--enable-prefix-caching
  ready 8100 8101 || { stop_all; exit 1; }
  log "tp2 and on ready"
  grep -h "attention block size\|KV cache size\|Maximum concurrency" $OUT/*.log | sort | uniq -c > $OUT/blocks.txt
  profile on http://127.0.0.1:8101 1 --block-tokens $(block_of $OUT/on.log)
  tail -4 $OUT/profile-on.log
  profile tp2 http://127.0.0.1:8100 2 --block-tokens $(block_of $OUT/tp2.log)
  tail -4 $OUT/profile-tp2.log
  stop_all
fi
log done
tar czf /tmp/results.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/results.tgz $OUT/results.tgz
