#!/usr/bin/env bash
# One device call: correctness, CUDA graphs, DBO and benchmarks of the generated modules.
#   bash benchmarks/run_gpu.sh [--quick] [--only correctness,graphs,dbo,bench] [multi_gpu.py args]
# Env: NPROC (GPUs, default 2), PY (default python3), MODULES (pre-compiled modules carried
# to the device, default build/generated), OUT (results; default benchmarks/results),
# HARD_TIMEOUT (seconds, default 570). CPU rehearsal:
#   PY=/work/venv/bin/python bash benchmarks/run_gpu.sh --dry-run [--fake]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
NPROC=${NPROC:-2}
MODULES=${MODULES:-build/generated}
HARD_TIMEOUT=${HARD_TIMEOUT:-570}
[ -n "${OUT:-}" ] && mkdir -p "$OUT"

user_modules=0; fake=0
for a in "$@"; do
  case "$a" in --modules|--modules=*) user_modules=1 ;; --fake) fake=1 ;; esac
done

# Compile here when the compiler can run (needs pydantic); else use the carried modules.
if [ "$user_modules" = 0 ] && [ "$fake" = 0 ] && "$PY" -c "import pydantic" 2>/dev/null; then
  fresh=$(mktemp -d /tmp/dcpc-generated.XXXXXX)
  if command -v dcpc >/dev/null 2>&1; then compile=(dcpc compile)
  else compile=("$PY" -c "import sys; from dcpc.cli import main; sys.exit(main())" compile); fi
  if "${compile[@]}" schedules/*.yaml -o "$fresh" && [ -f "$fresh/kimi_k3_dcp.py" ]; then
    MODULES=$fresh; echo "run_gpu.sh: compiled schedules into $MODULES"
  else
    echo "run_gpu.sh: compile failed; using carried modules in $MODULES"
  fi
else
  echo "run_gpu.sh: no compiler here (or --modules/--fake given); modules: $MODULES"
fi
ls "$MODULES" 2>/dev/null | sed 's/^/  module: /'

timeout -k 15 "$HARD_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  -m benchmarks.multi_gpu --modules "$MODULES" "$@"
rc=$?
echo "run_gpu.sh: exit $rc; results:"; ls -l "${OUT:-benchmarks/results}" 2>/dev/null
exit $rc
