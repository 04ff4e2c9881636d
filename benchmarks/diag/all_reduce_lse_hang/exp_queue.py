"""GPU experiment for the all_reduce lse hang (W=4, local backend, one GPU).

usage: python benchmarks/diag/all_reduce_lse_hang/exp_queue.py {base|sync} [W]
  base: the module as generated
  sync: the host waits for the push kernel (its stream) before launching _merge, so no
        kernel is ever queued behind a spinning one (tests the hardware-queue hypothesis)
Prints the outcome (each failed rank's error: code, step, peer, epoch).
"""
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DCPC_TRAP", "0")

def main() -> None:
    mode, world = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4
    import torch
    print("cuda initialised before LocalGroup:", torch.cuda.is_initialized(),
          "CUDA_DEVICE_MAX_CONNECTIONS=", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    from dcpc.harness import worker
    from dcpc.harness.run import compile_to
    patch = ()
    if mode == "sync":
        patch = (("            _block_n, _block_d = _tune.tiles[1]\n",
                  "            torch.cuda.current_stream().synchronize()\n"
                  "            _block_n, _block_d = _tune.tiles[1]\n"),)
    tmp = Path(tempfile.mkdtemp(prefix="lsehang-"))
    used, module, _, _ = compile_to("schedules/ops/all_reduce_lse.yaml", tmp, world, patch=patch)
    try:
        out = worker.run_local(0, 1, ranks=world, device="cuda", schedule_path=str(used),
                               module_path=module, backend="local", calls=2, seed=0,
                               jitter_s=0.0, timeout_s=20.0, group_timeout_s=150.0)
        print("CLEAN:", [(r.rank, r.epochs) for r in out])
    except Exception as exc:  # noqa: BLE001
        print("FAILED:", str(exc)[:3000])

if __name__ == "__main__":
    main()
