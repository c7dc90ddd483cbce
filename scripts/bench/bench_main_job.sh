#!/usr/bin/env bash
# The README main job side by side, one run after another on the same machine: this checkout's defaults, the
# same with --draft none, optionally a previous checkout's defaults (--prev DIR: a git worktree of an older
# commit, run from its own folder so its code is the one imported), and this checkout's defaults beside two
# busy-looping processes. Prints one line per run (wall seconds including model load, load average) and the
# CPU model; outputs go to OUT/<run> (default out/bench_main).
#
#   bash scripts/bench/bench_main_job.sh
#   git worktree add /tmp/prev 625a6ab && bash scripts/bench/bench_main_job.sh --prev /tmp/prev
#   bash scripts/bench/bench_main_job.sh --input examples/prompts.jsonl --out out/bench_main
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
INPUT=examples/prompts.jsonl OUT=out/bench_main PREV="" HOGS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --input) INPUT=${2:?--input needs a file}; shift 2 ;;
    --out) OUT=${2:?--out needs a directory}; shift 2 ;;
    --prev) PREV=${2:?--prev needs a checkout directory}; shift 2 ;;
    --hogs) HOGS=${2:?--hogs needs a number}; shift 2 ;;
    *) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
INPUT=$(realpath "$INPUT") OUT=$(realpath -m "$OUT")
mkdir -p "$OUT"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores; load before: $(cut -d' ' -f1-3 /proc/loadavg)"

run() {  # name, then the command (gets -o OUT/name)
  local name=$1; shift
  rm -rf "${OUT:?}/$name"
  local t0 t1
  t0=$(date +%s.%N)
  "$@" -o "$OUT/$name" > "$OUT/$name.log" 2>&1 || { echo "$name: failed, see $OUT/$name.log" >&2; return 1; }
  t1=$(date +%s.%N)
  echo "$name: $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s (load $(cut -d' ' -f1 /proc/loadavg)); $(tail -1 "$OUT/$name.log")"
}

run defaults dspine-batch generate "$INPUT"
run draft_none dspine-batch generate "$INPUT" --draft none
if [ -n "$PREV" ]; then
  run previous bash -c 'cd "$1" && shift && exec "$0" -m dspine_batch.cli generate "$@"' "$PY" "$(realpath "$PREV")" "$INPUT"
fi
hogs=()
for _ in $(seq "$HOGS"); do "$PY" -c 'while True: pass' & hogs+=($!); done
trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
sleep 1
run "beside_${HOGS}_hogs" dspine-batch generate "$INPUT"
