"""dcpc on GPUs in one call: correctness, CUDA-graph replays, DBO, benchmarks vs NCCL.

    python3 -m torch.distributed.run --nproc-per-node 2 -m benchmarks.multi_gpu \\
        --modules build/generated [--quick] [--only correctness,graphs,dbo,bench]

(benchmarks/run_gpu.sh does this, with the multicast-off environment.) Results go to
$OUT (else benchmarks/results/): gpu_results.json, gpu_results.md, gpu_latency.png,
rewritten after every section, so a run cut short still leaves its numbers.
CPU rehearsal: ``--dry-run`` (gloo, Triton interpreter, tiny sizes; ``--fake`` uses
stand-in modules when no generated ones exist).
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

import argparse  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.support.context import Ctx, GpuStuck, metadata, write_json  # noqa: E402

SECTIONS = ("correctness", "graphs", "dbo", "bench", "dbo_crossed")
REPO = Path(__file__).resolve().parent.parent


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; list defaults depend on --quick / --dry-run (see ``resolve``)."""
    ap = argparse.ArgumentParser(description="dcpc GPU correctness + benchmarks")
    ap.add_argument("--modules", type=Path, default=REPO / "build" / "generated",
                    help="folder of generated <schedule>.py modules")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default $OUT, else benchmarks/results)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and replays")
    ap.add_argument("--only", default="all",
                    help="comma list of: correctness, graphs, dbo, bench (dbo includes the "
                         "crossed-order run), or all")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes")
    ap.add_argument("--fake", action="store_true", help="stand-in modules (flow test)")
    ap.add_argument("--heads", type=_ints, default=None)
    ap.add_argument("--tokens", type=_ints, default=None)
    ap.add_argument("--replays", type=int, default=None, help="graph replays per config")
    ap.add_argument("--dbo-iters", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None, help="calls per timed graph")
    ap.add_argument("--reps", type=int, default=None, help="timed replays per benchmark")
    ap.add_argument("--kv-mb", type=_ints, default=None, help="KV MB per rank")
    ap.add_argument("--backends", default=None, help="fast,reference (symm_mem,torch)")
    ap.add_argument("--deadline", type=float, default=450.0,
                    help="seconds; sections stop starting work after it, hard exit 30 s later")
    ap.add_argument("--no-crossed", action="store_true", help="skip crossed-order DBO")
    ap.add_argument("--programs", type=int, default=None,
                    help="programs per signalling launch (default: the modules' own)")
    return ap.parse_args(argv)


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Concrete settings: explicit flags win, then --dry-run, then --quick, then full."""
    if args.dry_run:
        base: dict[str, Any] = dict(heads=[4], tokens=[1, 5], replays=6, dbo_iters=3,
                                    iters=2, reps=2, kv_mb=[1], graph_cfg=[(4, 5)],
                                    dbo_cfg=[(4, 5)],
                                    backends=["symm_mem", "torch"] if args.fake
                                    else ["host", "torch"])
    elif args.quick:
        base = dict(heads=[64], tokens=[1, 8, 512], replays=200, dbo_iters=30, iters=20,
                    reps=7, kv_mb=[1, 16], graph_cfg=[(64, 8)], dbo_cfg=[(64, 8)],
                    backends=["symm_mem", "torch"])
    else:
        base = dict(heads=[64, 96], tokens=[1, 8, 64, 512], replays=1000, dbo_iters=100,
                    iters=50, reps=15, kv_mb=[1, 4, 16, 64], graph_cfg=[(64, 1), (96, 64)],
                    dbo_cfg=[(64, 8), (96, 64)], backends=["symm_mem", "torch"])
    for key in ("heads", "tokens", "replays", "dbo_iters", "iters", "reps", "kv_mb"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    if args.heads is not None or args.tokens is not None:
        base["graph_cfg"] = [(base["heads"][0], base["tokens"][-1])]
        base["dbo_cfg"] = [(base["heads"][0], base["tokens"][-1])]
    if args.backends:
        base["backends"] = args.backends.split(",")
    only = set(SECTIONS) if args.only == "all" else set(args.only.split(","))
    if "dbo" in only and not args.no_crossed:
        only.add("dbo_crossed")
    unknown = only - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS[:4]}")
    base["sections"] = [s for s in SECTIONS if s in only]
    return base


def save(ctx: Ctx, final: bool = False) -> None:
    """Rank 0 writes json + md (and the plot when ``final``); never raises."""
    if ctx.rank != 0:
        return
    try:
        from benchmarks.report.tables import render, staging_gain, targets

        ctx.results["targets"] = targets(ctx.results)
        ctx.results["staging_gain"] = staging_gain(ctx.results)
        if final:
            from benchmarks.report.plot import make_plot

            why = make_plot(ctx.results, ctx.out_dir / "gpu_latency.png")
            ctx.results["plot"] = why or "gpu_latency.png"
        write_json(ctx.out_dir / "gpu_results.json", ctx.results)
        (ctx.out_dir / "gpu_results.md").write_text(render(ctx.results))
    except Exception as exc:  # noqa: BLE001 - writing must not kill the run
        print(f"[r0] could not write results: {type(exc).__name__}: {exc}", flush=True)


def summary(ctx: Ctx) -> None:
    """A short closing printout (the device tool returns only the output's tail)."""
    if ctx.rank != 0:
        return
    r = ctx.results
    print(f"==== status: {r.get('status')}", flush=True)
    for key in ("correctness", "graphs", "dbo"):
        recs = r.get(key, [])
        bad = [x for x in recs if not x.get("ok")]
        print(f"{key}: {len(recs) - len(bad)}/{len(recs)} ok"
              + "".join(f"\n  FAIL {x.get('schedule')} {x.get('backend', x.get('order', ''))} "
                        f"H={x.get('H')} T={x.get('T')} r{x.get('rank')}: "
                        f"{str(x.get('error') or x.get('buffers') or '')[:160]}"
                        for x in bad[:12]))
    for t in r.get("targets", []):
        where = f"MB={t['mb_per_rank']}" if t.get("mb_per_rank") else f"H={t['H']} T={t['T']}"
        print(f"{'PASS' if t['pass'] else 'FAIL'} {t['target']} {where}: ratio "
              f"{t['ratio']:.3f} ({t['us']:.1f} vs {t['ref_us']:.1f} us)")
    print(f"errors: {len(r.get('errors', []))}; sections: "
          + ", ".join(f"{k}={v.get('status')}" for k, v in r.get("sections", {}).items()),
          flush=True)


def fatal(ctx: Ctx, status: str, code: int) -> None:
    """The device is unusable (hang, dead context) or time is up: write and leave now."""
    ctx.results["status"] = status
    ctx.log(f"FATAL: {status}; writing results and exiting", all_ranks=True)
    save(ctx, final=True)
    summary(ctx)
    sys.stdout.flush()
    os._exit(code)


def watchdog(ctx: Ctx, grace: float) -> None:
    """Exit (after writing) if the run is still going ``grace`` s past its deadline."""
    def run() -> None:
        while ctx.left() > -grace:
            time.sleep(1.0)
        ctx.error("run", "deadline", f"hard deadline passed ({grace:.0f} s grace)")
        fatal(ctx, "hard deadline exceeded", 124)

    threading.Thread(target=run, daemon=True, name="dcpc-watchdog").start()


PER_RANK = ("correctness", "graphs", "dbo", "errors")


def merge_ranks(ctx: Ctx, marks: dict[str, int]) -> None:
    """Collective: rank 0 gets every rank's per-rank records added since ``marks``."""
    mine = {k: ctx.results.setdefault(k, [])[marks.get(k, 0):] for k in PER_RANK}
    for recs in mine.values():
        for r in recs:
            r.setdefault("rank", ctx.rank)
    everyone: list[Any] = [None] * ctx.world
    dist.all_gather_object(everyone, mine)
    if ctx.rank == 0:
        for other in everyone[1:]:
            for k, recs in (other or {}).items():
                ctx.results[k].extend(recs)


def run_section(ctx: Ctx, name: str, body: Callable[[], None]) -> None:
    """Run a section; record status, time and any error; keep going unless the GPU is gone."""
    t0 = time.monotonic()
    marks = {k: len(ctx.results.setdefault(k, [])) for k in PER_RANK}
    ctx.log(f"=== section {name} ({ctx.left():.0f} s left)")
    status = "ok"
    try:
        body()
    except GpuStuck as exc:
        ctx.error(name, "section", exc)
        ctx.results["sections"][name] = {"status": "gpu stuck", "seconds": time.monotonic() - t0}
        fatal(ctx, f"gpu stuck in {name}", 3)
    except Exception as exc:  # noqa: BLE001
        ctx.error(name, "section", exc)
        status = "error"
        text = str(exc)
        if "CUDA error" in text or "illegal memory" in text or "device-side" in text:
            ctx.results["sections"][name] = {"status": "cuda error",
                                             "seconds": time.monotonic() - t0}
            fatal(ctx, f"CUDA error in {name}", 4)
    ctx.results["sections"][name] = {"status": status, "seconds": round(time.monotonic() - t0, 1)}
    try:
        merge_ranks(ctx, marks)
    except Exception as exc:  # noqa: BLE001
        ctx.error(name, "merge ranks", exc)
    if ctx.cuda:
        torch.cuda.empty_cache()
    save(ctx)


def main(argv: list[str] | None = None) -> int:
    """Set up the group, run the chosen sections, write results."""
    args = parse_args(argv)
    cfg = resolve(args)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    # a CPU rehearsal never overwrites the committed GPU results
    default_out = Path("/tmp/dcpc-dry-run") if args.dry_run else REPO / "benchmarks" / "results"
    out_dir = args.out or Path(os.environ.get("OUT") or default_out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    else:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=240))
    ctx = Ctx(rank, world, device, out_dir, time.monotonic() + args.deadline,
              quick=args.quick, dry_run=args.dry_run)
    ctx.results.update(meta=metadata(ctx, sys.argv), status="running", sections={},
                       errors=[], settings={k: v for k, v in cfg.items()},
                       heads=cfg["heads"], tokens=cfg["tokens"], world=world)
    ctx.log(f"W={world} device={ctx.results['meta'].get('device')} settings={cfg}")
    save(ctx)
    watchdog(ctx, grace=30.0)

    from benchmarks.sections.correctness import correctness
    from benchmarks.sections.dbo import dbo
    from benchmarks.sections.graphs import graphs
    from benchmarks.sections.latency import bench_all
    from benchmarks.support.modules import Registry

    reg = Registry(None if args.fake else args.modules, dist.group.WORLD, device,
                   fake=args.fake, programs=args.programs)
    fast = cfg["backends"][0]

    def run_dbo(crossed: bool) -> None:
        for H, T in cfg["dbo_cfg"][:1] if crossed else cfg["dbo_cfg"]:
            dbo(ctx, reg, H, T, cfg["dbo_iters"], crossed, fast)

    bodies: dict[str, Callable[[], None]] = {
        "correctness": lambda: correctness(ctx, reg, cfg["heads"], cfg["tokens"],
                                           cfg["backends"]),
        "graphs": lambda: graphs(ctx, reg, cfg["graph_cfg"], cfg["replays"], fast),
        "dbo": lambda: run_dbo(False),
        "bench": lambda: bench_all(ctx, reg, cfg["heads"], cfg["tokens"], cfg["iters"],
                                   cfg["reps"], cfg["kv_mb"], fast),
        "dbo_crossed": lambda: run_dbo(True),
    }
    for name in cfg["sections"]:
        run_section(ctx, name, bodies[name])
    n_err = len(ctx.results["errors"])
    ctx.results["status"] = "done" if n_err == 0 else f"done with {n_err} error(s) on rank 0"
    save(ctx, final=True)
    summary(ctx)
    ctx.log(f"done in {time.monotonic() - ctx.t0:.0f} s; results in {out_dir}")
    reg.close_all()
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        ctx.log(f"teardown: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
