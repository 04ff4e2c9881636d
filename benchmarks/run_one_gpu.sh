#!/usr/bin/env bash
# One device call, one GPU: the whole suite at W = 2, 4 and 8 (ranks as threads, backend
# local). Phase 1, the checks (correctness vs float64, CUDA-graph replays, DBO; the engine
# adapters' tests on this GPU): one process per W, all at once (their JIT compiles share the CPU cores; the
# GPU time-slices between the processes, each W's ranks stay in one). Phase 2, alone on
# the GPU: latency, the guard's cost, host time per call. Then one merged report.
#   bash benchmarks/run_one_gpu.sh [--quick] [one_gpu.py args for every phase]
# Env: PY (default python3), MODULES (pre-compiled modules, default build/generated), OUT
# (results; default benchmarks/results), WORLDS (default "2 4 8"), CHECK_DEADLINE (s, 380),
# BENCH_DEADLINE (s, 100): at most 380 + 40 + 100 + 40 s in all, inside one 600 s device call.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_MODULE_LOADING=EAGER  # a lazy module load while a peer's kernel spins hangs
export CUDA_DEVICE_MAX_CONNECTIONS=32  # a hardware queue per stream (W ranks x slots)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
MODULES=${MODULES:-build/generated}
OUT=${OUT:-benchmarks/results}
WORLDS=${WORLDS:-2 4 8}
CHECK_DEADLINE=${CHECK_DEADLINE:-380}
BENCH_DEADLINE=${BENCH_DEADLINE:-100}
mkdir -p "$OUT/parts"
if "$PY" -c "import pydantic" 2>/dev/null && [ -z "${KEEP_MODULES:-}" ]; then
  "$PY" -c "import sys; from dcpc.cli import main; sys.exit(main())" compile schedules/*.yaml \
    -o "$MODULES" && echo "run_one_gpu.sh: compiled schedules into $MODULES"
else
  echo "run_one_gpu.sh: no compiler here; carried modules in $MODULES"
fi
ls "$MODULES" 2>/dev/null | sed 's/^/  module: /'
pids=()
for W in $WORLDS; do
  timeout -k 10 $((CHECK_DEADLINE + 40)) "$PY" -m benchmarks.one_gpu --modules "$MODULES" \
    --worlds "$W" --only correctness,graphs,dbo --deadline "$CHECK_DEADLINE" \
    --out "$OUT/parts/checks_w$W" "$@" > "$OUT/parts/checks_w$W.log" 2>&1 &
  pids+=($!)
done
# the engine adapters (dcpc.engines, vLLM's and SGLang's functions) on this GPU: their
# tests, ranks as threads (backend local), against float64 (the kernel_mask_* cases: the
# empty-shard mask in-kernel); in this one process (no parallel workers: the ranks'
# threads share the GPU, and the device may not have pytest-xdist)
DCPC_TEST_DEVICE=cuda:0 timeout -k 10 "$CHECK_DEADLINE" "$PY" -m pytest -q -o addopts= \
  -p no:xdist -p no:cacheprovider tests/engines/test_engines_local.py > "$OUT/parts/engines.log" 2>&1 &
pids+=($!)
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
echo "== engines"; tail -n 3 "$OUT/parts/engines.log"
for W in $WORLDS; do echo "== checks W=$W"; tail -n 4 "$OUT/parts/checks_w$W.log"; done
timeout -k 10 $((BENCH_DEADLINE + 40)) "$PY" -m benchmarks.one_gpu --modules "$MODULES" \
  --worlds "$(echo $WORLDS | tr ' ' ,)" --only latency,guard,host --deadline "$BENCH_DEADLINE" \
  --out "$OUT/parts/bench" "$@" 2>&1 | tail -n 30 || rc=$?
"$PY" -m benchmarks.report.merge "$OUT"/parts/checks_w*/one_gpu_results.json \
  "$OUT/parts/bench/one_gpu_results.json" --engines "$OUT/parts/engines.log" -o "$OUT"
echo "run_one_gpu.sh: exit $rc"
exit $rc
