#!/bin/bash
# Issue #35, part 3: what a prefill costs vLLM 0.26 with prefix caching on, by the length of its prefix hit (the multi-turn
# timeline, ../2026-11-28-gpu-multiturn-timeline, found a P/D prefill worker's later turns 45-75 ms for 400-800 computed tokens
# at one request in flight). One GPU (vLLM 0.26 from ../shared/gpu), Nemotron-H-8B at its published size, three colocated
# servers sharing it, measured one at a time (probe_hits.py): caching on in vLLM's default Mamba cache mode for it ('all'),
# on in mode 'align', and off. Prompts resume 0-3 blocks and compute 200 or 800 tokens more, one at a time and four at once.
# Calls (the machine goes cold ~30 s after a call: never leave a gap):
#   call 3: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash hybrid_pd/bench/results/2026-11-28-gpu-prefix-hit-cost/run.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${DIR:-/tmp/hit-cost}
M=/tmp/full/nemotron_h
export PYTHONPATH=$PWD:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0))s] $*"; }
mkdir -p $DIR/logs
nvidia-smi -L > $DIR/gpus.txt
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" > $DIR/versions.txt 2>&1
git -C $PWD rev-parse HEAD > $DIR/commit.txt 2>/dev/null
if [ ! -f $M/config.json ]; then
  python3 -m hybrid_pd.models.families /tmp/full --full nemotron_h > $DIR/build.log 2>&1 || { log "build failed"; tail -20 $DIR/build.log; exit 1; }
fi
log "model ready"
# name port extra...
SERVERS=("all 8100 --vllm-arg=--enable-prefix-caching" "align 8101 --vllm-arg=--enable-prefix-caching --vllm-arg=--mamba-cache-mode=align"
         "off 8102 --vllm-arg=--no-enable-prefix-caching")
for s in "${SERVERS[@]}"; do
  read -r name port extra <<< "$s"
  setsid python3 -m hybrid_pd.cli colocated --model $M --served-model-name nemotron-h-8b --device cuda --max-model-len 4096 --max-num-seqs 128 \
    --gpu-memory-utilization 0.3 --kv-cache-memory-bytes 4294967296 --port $port $extra > $DIR/logs/$name.log 2>&1 < /dev/null &
  echo $! > $DIR/pid-$name
done
for p in 8100 8101 8102; do
  until curl -sf 127.0.0.1:$p/health > /dev/null; do
    [ $(($(date +%s) - T0)) -gt 400 ] && { log "port $p not ready"; tail -20 $DIR/logs/*.log; break 2; }
    sleep 3
  done
done
log "servers ready"
for s in "${SERVERS[@]}"; do
  read -r name port extra <<< "$s"
  block=$(grep -ho "Setting attention block size to [0-9]* tokens" $DIR/logs/all.log | tail -1 | grep -o "[0-9]*" | head -1)
  python3 $HERE/probe_hits.py --server $name=http://127.0.0.1:$port --block ${block:-1152} --out $DIR/hits-$name.json > $DIR/hits-$name.log 2>&1
  log "$name rc $? block ${block:-?}"; cut -c1-400 $DIR/hits-$name.log
done
for f in $DIR/pid-*; do kill -TERM -- -"$(cat $f)" 2>/dev/null; done
grep -h "mamba_cache_mode\|Mamba cache mode\|Setting attention block" $DIR/logs/*.log | cut -c1-250 | sort | uniq -c
tar -C $(dirname $DIR) -czf "${OUT:?set OUT (the device call sets it)}/results.tar.gz" $(basename $DIR)
