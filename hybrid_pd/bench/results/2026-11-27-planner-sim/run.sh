#!/usr/bin/env bash
# The planner simulated (hybrid-pd size --phases) with the H100 profile: the four-GPU phase-shifting traffic, and each
# point of the two-GPU matrix of docs/performance.md as one phase. CPU only, about a minute. Writes beside this script.
set -euo pipefail
cd "$(dirname "$0")"
four=../2026-11-27-sim-refit/h100x4-profile.json  # refitted to the four-GPU run (docs/sizing.md, "Against the four-H100 run")
two=../2026-11-25-h100x2-sizing/profile.json
hybrid-pd size --profile $four --gpus 4 --slo-ttft-ms 4000 --slo-tpot-ms 15 \
  --phases 1000/512@64x384,16000/256@32x192,1000/512@64x384 --json four-gpu-phases.json | tee four-gpu-phases.txt
# the same with the chat at 128 in flight (where 1P3D is best under 500/20), under three SLO pairs
for slo in "4000 15" "500 20" "4000 10"; do
  set -- $slo
  hybrid-pd size --profile $four --gpus 4 --slo-ttft-ms $1 --slo-tpot-ms $2 \
    --phases 1000/512@128x768,16000/256@32x192,1000/512@128x768 --json four-gpu-phases-c128-$1-$2.json | tee four-gpu-phases-c128-$1-$2.txt
done
# each phase asking for its own SLO (the x-slo-* headers): chat 500/20 (1P3D best), documents 4000/15 (3P1D best); the GPU run's traffic
hybrid-pd size --profile $four --gpus 4 --slo-ttft-ms 500 --slo-tpot-ms 20 \
  --phases 1000/512@128x768:500/20,16000/256@32x256:4000/15,1000/512@128x768:500/20 --json four-gpu-phases-slo-per-phase.json | tee four-gpu-phases-slo-per-phase.txt
: > two-gpu-matrix.txt
for w in 3000/128 1000/64 1000/512 200/1000; do
  for c in 1 32 64; do
    n=$((c * 6 > 96 ? c * 6 : 96))
    echo "== $w @ $c" >> two-gpu-matrix.txt
    hybrid-pd size --profile $two --gpus 2 --slo-ttft-ms 500 --slo-tpot-ms 20 --phases "$w@${c}x$n" >> two-gpu-matrix.txt
  done
done
