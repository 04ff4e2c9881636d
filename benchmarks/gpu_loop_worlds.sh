#!/usr/bin/env bash
# One module for every W of a loop, on the GPU: compile each loop file ONCE for W 2..8
# (`dcpc compile --world 2..8`), then run that one file at several W with
# `dcpc run --module M --device cuda` (W ranks as threads on one GPU, backend local)
# against float64. Prints one line per run and a summary; exit 0 only when all are clean.
#   bash benchmarks/gpu_loop_worlds.sh [OUT_DIR] [WORLDS...]   (default worlds: 2 3 4 8)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}  # cpu: a smoke test of the script under the interpreter
OUT=${1:-/tmp/dcpc-loop-worlds}; shift || true
WORLDS=${*:-2 3 4 8}
FILES="schedules/gallery/ring_attention.yaml schedules/ops/shift_ring.yaml"
mkdir -p "$OUT"
fail=0; runs=0
one() {  # stem file module w: one run, its status line in $OUT/<stem>.W<w>.status
  local log="$OUT/$1.W$4.txt" rc result
  timeout 300 "$PY" -m dcpc run "$2" --module "$3" --world "$4" --device "$DEVICE" \
    --calls 8 --wait-timeout 20 --timeout 240 > "$log" 2>&1
  rc=$?
  result=$(grep -m1 "^result" "$log" || tail -1 "$log")
  if [ "$rc" -eq 0 ]; then echo "ok   $1 W=$4: $result"; else echo "FAIL $1 W=$4 rc=$rc: $result"; fi \
    > "$OUT/$1.W$4.status"
}
for f in $FILES; do
  stem=$(basename "$f" .yaml)
  "$PY" -m dcpc compile "$f" --world 2..8 -o "$OUT/$stem" > "$OUT/$stem.compile.txt" 2>&1 \
    || { echo "FAIL compile $f"; cat "$OUT/$stem.compile.txt"; fail=1; continue; }
  module=$(ls "$OUT/$stem"/*.py | head -1)
  echo "compiled $f once for W 2..8: $module ($(wc -l < "$module") lines)"
  for w in $WORLDS; do one "$stem" "$f" "$module" "$w" & done  # the W at once, on one GPU
  wait
  for w in $WORLDS; do
    runs=$((runs + 1)); cat "$OUT/$stem.W$w.status"
    grep -q "^ok" "$OUT/$stem.W$w.status" || fail=1
  done
done
echo "gpu_loop_worlds: $runs runs, $([ $fail = 0 ] && echo all clean || echo FAILURES)"
exit $fail
