"""The signal floor over W: the serial signalling loop against the parallel one (issue 24).

    python3 -m benchmarks.signal_floor [--worlds 2,4,8] [--iters 50] [--reps 15] [--out DIR]

One kernel, one program, no payload: signal every peer, wait for every peer. Two kernels
with the same parameters and signal bank: ``parallel`` is the emitted code itself
(templates/sync.j2: one vector release, a lane per peer, then parallel polls), ``serial``
the loop the templates emitted before (one release per peer, then one spin per peer, one
after another; benchmarks/support/signal_floor.py.j2). Per W, W ranks run as threads on
ONE device (dcpc.runtime.local), each kernel is timed over CUDA-graph replays
(benchmarks.support.context.bench: median us per launch, max over ranks), and the
slope of each over W (least squares, us per extra peer) is the per-peer cost. Prints one
JSON object (also written to DIR/signal_floor.json when --out is given). On one GPU every
"peer" is the same GPU's memory, so the slope is the cost of the signalling code, not of
NVLink round trips. On CPU (TRITON_INTERPRET=1) the same code runs eagerly: a smoke test
of the kernels and the output, not a timing.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # before CUDA starts: see local.py
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KINDS = ("serial", "parallel")  # channel 0 and 1 of the bank


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def render(folder: Path) -> ModuleType:
    """The two floor kernels as a module: sync.j2's macros rendered as dcpc emits them, its
    file in ``folder`` (Triton reads a kernel's source from its file: keep it while they run)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(REPO / "benchmarks" / "support"),
                                        str(REPO / "templates")]),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
        lstrip_blocks=True, autoescape=False)
    env.filters.update(chomp=lambda t: t[:-1] if t.endswith("\n") else t,
                       docstring=lambda t, *_: t)
    from dcpc.codegen.emit import device_imports

    text = env.get_template("signal_floor.py.j2").render()
    text = text.replace("# DEVICE_IMPORTS", device_imports(text) + "  #", 1)
    path = folder / "dcpc_signal_floor.py"
    path.write_text(text)  # Triton reads a kernel's source from its file
    spec = importlib.util.spec_from_file_location("dcpc_signal_floor", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of time over W (us per extra peer); None below two points."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(w for w, _ in points) / n
    my = sum(t for _, t in points) / n
    den = sum((w - mx) ** 2 for w, _ in points)
    return sum((w - mx) * (t - my) for w, t in points) / den if den else None


def one_world(kernels: ModuleType, world: int, device: torch.device, iters: int, reps: int,
              timeout_s: float) -> dict[str, Any]:
    """Both floors at ``world`` ranks; their times, and what each rank's bank says after."""
    from benchmarks.support.context import Ctx, bench
    from dcpc.runtime import sync, tiles
    from dcpc.runtime.local import LocalGroup, LocalThreadHeap

    group = LocalGroup(world, device, timeout_s=timeout_s)
    cuda = device.type == "cuda"

    def body(rank: Any) -> dict[str, Any]:
        ctx = Ctx(rank.rank, world, device, Path("."), time.monotonic() + timeout_s,
                  comm=rank)
        (segment,) = LocalThreadHeap(rank, device).allocate(
            [sync.signal_nbytes(len(KINDS), world, 1)])
        bank = sync.SignalBank(segment, len(KINDS), world, 1, device)
        rank.barrier()
        consts = {"STEP": 0, "RANK": rank.rank, "WORLD": world,
                  "WP2": tiles.next_pow2(world), "TRAP": False, "CLOCK": cuda, "GUARD": True}
        watchdog = None if cuda else sync.Watchdog(bank.errors, timeout_s)
        out: dict[str, Any] = {}
        try:
            for channel, kind in enumerate(KINDS):
                kernel = getattr(kernels, f"_{kind}_floor")

                def launch(kernel: Any = kernel, channel: int = channel) -> None:
                    kernel[(1,)](bank.sig_ptrs, bank.epochs, bank.errors, channel, channel, 1,
                                 12345, int(timeout_s * 1e9), **consts, num_warps=1)

                if watchdog is not None:
                    watchdog.arm()
                out[f"{kind}_us"] = bench(ctx, launch, iters=iters, reps=reps)
                if watchdog is not None:
                    watchdog.disarm()
            rank.barrier()
            out["epochs"] = [int(e) for e in bank.epochs[:, 0].cpu().tolist()]
            out["errors"] = [int(e) for e in bank.errors.cpu().tolist()]
        finally:
            if watchdog is not None:
                watchdog.close()
        return out

    per_rank = group.run(body)
    launches = 2 + iters * (1 + reps) if cuda else 1 + reps * iters  # what bench() runs
    return {
        "world": world,
        **{f"{k}_us": per_rank[0][f"{k}_us"] for k in KINDS},  # bench: max over ranks
        "launches": launches,
        "epochs_ok": all(r["epochs"] == [launches] * len(KINDS) for r in per_rank),
        "errors_ok": all(not any(r["errors"]) for r in per_rank),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=_ints, default=[2, 4, 8])
    ap.add_argument("--iters", type=int, default=50, help="launches per timed graph")
    ap.add_argument("--reps", type=int, default=15, help="timed replays per kernel")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per W")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("on CPU set TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
    with tempfile.TemporaryDirectory(prefix="dcpc-floor-") as build:
        kernels = render(Path(build))
        rows = [one_world(kernels, w, device, args.iters, args.reps, args.timeout)
                for w in args.worlds]
    result = {
        "what": "signal floor: one launch signals and waits for every peer, us per launch",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu "
                  "(Triton interpreter: not a timing)",
        "iters": args.iters, "reps": args.reps, "worlds": rows,
        "slope_us_per_peer": {k: slope([(r["world"], r[f"{k}_us"]) for r in rows])
                              for k in KINDS},
        "ok": all(r["epochs_ok"] and r["errors_ok"] for r in rows),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "signal_floor.json").write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
