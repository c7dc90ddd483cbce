#!/usr/bin/env bash
# Operations as a cluster user meets them (issue 36), on the README's main job: wall seconds of
#   first          `generate` on an empty cache (kernel build, model conversion, calibration, generation)
#   noop           the same command again: every row committed, so it ends before loading the model
#   prepare        `dspine-batch prepare` on another empty cache, then again (idempotent)
#   after_prepare  the main job on the prepared cache, then its no-op rerun
# Each line has the 1-minute load before and after (the machine may be shared). Outputs and logs in OUT.
#   bash scripts/bench/bench_ops.sh [OUT]      (default /tmp/bench_ops)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-/tmp/bench_ops}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} DSPINE_BATCH_PROGRESS=none
rm -rf "$OUT" && mkdir -p "$OUT"
grep -m1 "model name" /proc/cpuinfo
t() {
  local name=$1; shift
  local l0 s e rc
  l0=$(cut -d' ' -f1 /proc/loadavg); s=$(date +%s.%N)
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"; rc=$?
  e=$(date +%s.%N)
  printf '%-14s rc=%s %7.1f s  load %s -> %s\n' "$name" "$rc" "$(echo "$e - $s" | bc)" "$l0" "$(cut -d' ' -f1 /proc/loadavg)"
}
gen() { python -m dspine_batch.cli generate examples/prompts.jsonl -o "$1"; }
DSPINE_CACHE_DIR=$OUT/cache1 t first gen "$OUT/out1"
DSPINE_CACHE_DIR=$OUT/cache1 t noop gen "$OUT/out1"
DSPINE_CACHE_DIR=$OUT/cache2 t prepare python -m dspine_batch.cli prepare
DSPINE_CACHE_DIR=$OUT/cache2 t prepare_again python -m dspine_batch.cli prepare
DSPINE_CACHE_DIR=$OUT/cache2 t after_prepare gen "$OUT/out2"
DSPINE_CACHE_DIR=$OUT/cache2 t noop_after gen "$OUT/out2"
cat "$OUT/prepare.out"
python -m dspine_batch.cli report "$OUT/out2"
