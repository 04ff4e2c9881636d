#!/usr/bin/env bash
# One device call, one GPU: the GPU conformance suite's pending cases in shards side by side.
#   python3 -m benchmarks.gpu_pending --plans PLANS [--shards 4] [--first FILE ...]  # here
#   COMMIT=<sha> OUT=<dir> bash benchmarks/conformance_shards.sh PLANS                  # there
# Each shard runs its plan's lines ("WORLDS FILE ...") one after another through
# benchmarks.gpu_conformance (JOBS cases at once, default 3: 4 shards of 4 ran 8-rank meshes
# out of an H100's 80 GB), all within END seconds (default 540); PLANS/slow.txt's cases
# (their newest run took gpu_pending's SLOW_S or more) run beside them, SLOW_JOBS at once
# (default 2), with rank timeouts of up to SLOW_WAIT seconds (default 420). Every result file ends up
# in OUT/conformance.tgz (a device call returns few files; DEVICE=cpu: a smoke test here);
# merge them here with
#   python3 -m benchmarks.gpu_conformance --out benchmarks/results --merge .../*.json
set -uo pipefail
cd "$(dirname "$0")/.."
PLANS=${1:?plan folder}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" COMMIT=${COMMIT:?the commit the results name}
OUT=${OUT:?a folder for the results}; END=${END:-540}; JOBS=${JOBS:-3}
work=$(mktemp -d /tmp/dcpc-shards.XXXXXX); t0=$(date +%s)
keys=(); [ -f "$PLANS/keys.json" ] && keys=(--keys "$PLANS/keys.json")  # gpu_pending --plans
shard() {  # shard PLAN INDEX [JOBS WAIT]: the last two for slow.txt
  local k=0 worlds files left jobs=${3:-$JOBS} wait=${4:-}
  while read -r worlds files; do
    k=$((k + 1)); left=$(( END - 40 - ($(date +%s) - t0) ))
    [ "$left" -gt 30 ] || { echo "shard $2: out of time before line $k"; break; }
    times=(); [ -n "$wait" ] && times=(--wait-timeout "$(( wait < left ? wait : left ))"
                                       --timeout "$(( wait + 40 < left ? wait + 40 : left ))")
    timeout -k 5 $((left + 35)) python3 -m benchmarks.gpu_conformance --out "$work/s$2_$k" \
      --repeat 1 --jobs "$jobs" --deadline "$left" --device "${DEVICE:-cuda}" \
      --worlds "$worlds" "${keys[@]}" "${times[@]}" $files
  done < "$1"
}
# the archive is packed every 30 s too: a call cut short (its device time spent, its
# limit below the one asked for) still returns every case finished so far
mkdir -p "$OUT"
pack() {  # pack TEMP: the archive so far (growing logs: tar exits 1, the archive stands)
  tar czf "$OUT/$1" -C "$work" --warning=no-file-changed --exclude='*.md' --exclude='*.part' .
  [ $? -le 1 ] && mv -f "$OUT/$1" "$OUT/conformance.tgz"
}
( trap exit TERM; while :; do sleep 30 & wait $!; pack partial.tgz; done ) & packer=$!
trap 'kill "$packer" 2>/dev/null' EXIT
i=0; shards=()
for plan in "$PLANS"/plan*.txt; do
  i=$((i + 1)); shard "$plan" "$i" > "$work/shard$i.log" 2>&1 & shards+=($!)
done
if [ -s "$PLANS/slow.txt" ]; then
  shard "$PLANS/slow.txt" slow "${SLOW_JOBS:-2}" "${SLOW_WAIT:-420}" > "$work/shardslow.log" 2>&1 & shards+=($!)
fi
wait "${shards[@]}"
kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null  # a pack under way ends first
grep -h "^FAIL\|clean in\|out of time" "$work"/shard*.log | cut -c1-600
pack final.tgz && ls -l "$OUT"
