#!/bin/bash
# Issue #35, "see it" inside vLLM: the decode-row segment (decode.scheduled -> decode.http_out: 11.8 ms at 1000 prompt
# tokens and 15.0 at 8000 on an H100, for a 6 ms decode step) split function by function on the GPU. The early-leg
# timeline run (../2026-11-27-h100-handoff-early-timeline) again, P/D against colocated only, with the probe
# (probe/sitecustomize.py, loaded through PYTHONPATH by every process of the run) timing vLLM's scheduler, model runner
# and output processor per call; analyze.py joins its records with the decode worker's timeline. One H100 (vLLM 0.26
# from ../shared/gpu), Nemotron-H-8B at its published size (the embedded 512-token tokenizer), a prefill worker, a decode
# worker and a colocated server sharing the GPU; 1000- and 8000-token prompts, 32 output tokens, 1 in flight, 32 prompts.
# The probe adds its own cost (a JSON line per call, ~10-20 us): segments are read against each other, not as absolutes.
# Calls (the machine goes cold ~30 s after a call: never leave a gap):
#   call 3: bash .gpu/c3/unpack.sh --all .gpu/c3/c3.tar.xz || exit; source .gpu/c3/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100-handoff-probe/run.sh start
#   call 4: bash /tmp/site/.gpu-payload/unpack.sh --all >/dev/null || exit; source /tmp/site/.gpu-payload/env.sh; bash hybrid_pd/bench/results/2026-11-27-h100-handoff-probe/run.sh wait 400; bash hybrid_pd/bench/results/2026-11-27-h100-handoff-probe/run.sh pack
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
STAGE=${1:-status}
DIR=${DIR:-/tmp/handoff-probe}
MODEL=/tmp/full/nemotron_h
case $STAGE in
start)
  mkdir -p $DIR/probe
  env DIR=$DIR/run VARIANTS=" " PYTHONPATH=$HERE/probe:$PWD:${PYTHONPATH:-/tmp/site} HANDOFF_PROBE_DIR=$DIR/probe \
    bash $HERE/../2026-11-27-h100-handoff-early-timeline/run.sh start
  ;;
wait)
  DIR=$DIR/run bash $HERE/../2026-11-27-h100-handoff-early-timeline/run.sh wait "${2:-540}"
  ;;
pack)
  python3 $HERE/analyze.py $DIR/probe $DIR/run/sweep/timeline > $DIR/analysis.txt 2>&1
  cat $DIR/analysis.txt
  DIR=$DIR/run bash $HERE/../2026-11-27-h100-handoff-early-timeline/run.sh pack
  cp $DIR/analysis.txt $DIR/probe/analysis.json "${OUT:?}/" 2>/dev/null
  tar -C $DIR -czf "$OUT/probe.tar.gz" probe
  ls -la $OUT
  ;;
*)
  echo "usage: $0 start | wait [SECONDS] | pack" >&2
  exit 2
  ;;
esac
