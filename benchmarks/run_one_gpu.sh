#!/usr/bin/env bash
# One device call, one GPU: the whole suite at W = 2, 4 and 8 (ranks as threads, backend
# local): correctness vs float64, CUDA-graph replays, DBO, latency, host time per call.
#   bash benchmarks/run_one_gpu.sh [--quick] [--worlds 2,4,8] [--only ...] [one_gpu.py args]
# Env: PY (default python3), MODULES (pre-compiled modules, default build/generated), OUT
# (results; default benchmarks/results), HARD_TIMEOUT (seconds, default 590).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_MODULE_LOADING=EAGER  # a lazy module load while a peer's kernel spins hangs
export CUDA_DEVICE_MAX_CONNECTIONS=32  # a hardware queue per stream (W ranks x slots)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
MODULES=${MODULES:-build/generated}
HARD_TIMEOUT=${HARD_TIMEOUT:-590}
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
if "$PY" -c "import pydantic" 2>/dev/null && [ -z "${KEEP_MODULES:-}" ]; then
  "$PY" -c "import sys; from dcpc.cli import main; sys.exit(main())" compile schedules/*.yaml \
    -o "$MODULES" && echo "run_one_gpu.sh: compiled schedules into $MODULES"
else
  echo "run_one_gpu.sh: no compiler here; carried modules in $MODULES"
fi
ls "$MODULES" 2>/dev/null | sed 's/^/  module: /'
timeout -k 10 "$HARD_TIMEOUT" "$PY" -m benchmarks.one_gpu --modules "$MODULES" "$@"
rc=$?
echo "run_one_gpu.sh: exit $rc"
exit $rc
