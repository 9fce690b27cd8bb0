#!/bin/bash
# The runs of 2026-11-26 on two H200s (vLLM 0.26 from ../shared/gpu): hybrid-pd profile of Nemotron-H-8B,
# prefix caching off and on, a TP-2 worker, and vllm bench serve against one GPU with caching off and on.
# Run from the checkout's root on the GPU machine, after the kit's unpack + env.sh:
#   bash run.sh pd [SEED_512 SEED_64]   # one GPU each: colocated off (GPU 0) and on (GPU 1), a flex P/D pair for the
#                                       # transfer; profiles on then off; benches 1000/512 and 1000/64 (seeds 21 22;
#                                       # the table's run 1 used 11 12)
#   bash run.sh tp2                     # one colocated worker on both GPUs; its profile
# Results go to one archive, $OUT/results.tgz (the machine returns 8 files a call). The calls ran earlier forms of
# this script (servers reused between calls, --block-tokens given by hand); this is them cleaned up, not re-run.
set -u
STAGE=$1 SEED_512=${2:-21} SEED_64=${3:-22}
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
ROUTER=http://127.0.0.1:8110 FLEX_P=http://127.0.0.1:8102 FLEX_D=http://127.0.0.1:8103

if [ "$STAGE" = pd ]; then
  serve off 0 8100 colocated
  serve on 1 8101 colocated --vllm-arg=--enable-prefix-caching
  serve flexp 0 8102 flex --side-channel-port 5600
  serve flexd 1 8103 flex --side-channel-port 5601
  ready 8100 8101 8102 8103 || { stop_all; exit 1; }
  setsid python3 -m hybrid_pd.cli router --port 8110 --local-prefill-below-tokens 0 --prefill $FLEX_P --decode $FLEX_D > $OUT/router.log 2>&1 &
  echo $! > /tmp/pid-router
  python3 -c "from hybrid_pd.router.health import wait_routed; import sys; sys.exit(not wait_routed('$ROUTER', {'$FLEX_P', '$FLEX_D'}, 90))" \
    || log "the router does not route to both flex workers"
  log "servers ready"
  profile on http://127.0.0.1:8101 1
  profile off http://127.0.0.1:8100 1 --transfer-router $ROUTER --transfer-metrics $FLEX_D
  for w in "512 $SEED_512" "64 $SEED_64"; do
    set -- $w
    bench off 8100 1000 $1 $2 & P1=$!
    bench on 8101 1000 $1 $2
    wait $P1  # not a bare wait: that would wait for the servers too
  done
else
  serve tp2 0,1 8100 colocated --tensor-parallel-size 2
  ready 8100 || { stop_all; exit 1; }
  log "tp2 ready"
  profile tp2 http://127.0.0.1:8100 2
fi
grep -h "attention block size\|KV cache size\|Maximum concurrency\|Mamba cache mode" $OUT/*.log | sort | uniq -c > $OUT/engines.txt
stop_all
log done
tar czf /tmp/results.tgz -C $OUT . && rm -rf $OUT/* && mv /tmp/results.tgz $OUT/results.tgz
