"""The whole suite on ONE GPU at W = 2, 4 and 8: W ranks as threads (dcpc.runtime.local).

    python3 -m benchmarks.one_gpu --modules build/generated [--quick] [--worlds 2,4,8]
        [--only correctness,graphs,dbo,latency,host]

(benchmarks/run_one_gpu.sh does this with the environment it needs.) Per W: correctness
of every shipped schedule against float64 (H x T grid), CUDA-graph replays with changing
inputs, DBO (two slots on two streams per rank), latency over CUDA-graph replays; then
host time per eager call (section host). Timings are ONE-DEVICE numbers: every rank's
"peer" is the same GPU's memory (no NVLink); they show how the kernels' own cost grows
with W, not what W GPUs would measure. The torch backend and the NCCL baselines need one
GPU per rank, so they are not run here (benchmarks/multi_gpu.py runs them).
Results: $OUT (else benchmarks/results/) one_gpu_results.json and one_gpu_results.md,
rewritten after every section.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # before CUDA starts: see local.py
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import argparse  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.support.context import (  # noqa: E402
    Ctx,
    GpuStuck,
    all_gather_objects,
    barrier,
    metadata,
    write_json,
)

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("correctness", "graphs", "latency", "guard", "dbo", "host")
PER_RANK = ("correctness", "graphs", "dbo", "errors")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=Path, default=REPO / "build" / "generated")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worlds", type=_ints, default=[2, 4, 8])
    ap.add_argument("--heads", type=_ints, default=[64, 96, 128])
    ap.add_argument("--tokens", type=_ints, default=[1, 8, 64, 512])
    ap.add_argument("--latency-heads", type=_ints, default=[64, 128])
    ap.add_argument("--replays", type=int, default=1000,
                    help="CUDA-graph replays per schedule and W, spread over the H x T grid")
    ap.add_argument("--dbo-iters", type=int, default=120,
                    help="DBO iterations per schedule and W, spread over the H x T grid")
    ap.add_argument("--iters", type=int, default=20, help="calls per timed graph")
    ap.add_argument("--reps", type=int, default=7, help="timed replays per benchmark")
    ap.add_argument("--programs", type=int, default=None,
                    help="programs per signalling launch (default: local's co-residency cap)")
    ap.add_argument("--quick", action="store_true", help="H=64, T in {1, 512}, fewer replays")
    ap.add_argument("--only", default="all")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole run")
    args = ap.parse_args(argv)
    if args.quick:
        args.heads, args.tokens, args.replays, args.dbo_iters = [64], [1, 512], 100, 20
    return args


def _merge(into: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
    for rank, recs in enumerate(per_rank):
        for key, items in recs.items():
            for item in items:
                item.setdefault("rank", rank)
            into.setdefault(key, []).extend(items)


def run_world(args: argparse.Namespace, W: int, results: dict[str, Any], deadline: float,
              save: Any, wanted: set[str]) -> None:
    """Every section at one W: W threads, one LocalGroup; rank 0 merges the records."""
    from benchmarks.sections.correctness import correctness
    from benchmarks.sections.dbo import dbo
    from benchmarks.sections.graphs import graphs
    from benchmarks.sections.latency import bench_all
    from benchmarks.support.modules import Registry
    from dcpc.runtime.local import LocalGroup, residency

    device = torch.device("cuda", 0)
    # generous: a slow last item may overrun its share; a hang is the watchdog's to end
    limit = min(deadline + 60.0, args.hard_deadline + 20.0) - time.monotonic()
    group = LocalGroup(W, device, timeout_s=max(30.0, limit))
    out = results["worlds"].setdefault(str(W), {"sections": {}})
    heads = [h for h in args.heads if h % W == 0]
    configs = [(h, t) for h in heads for t in args.tokens]  # graphs and DBO: every H x T
    per_config = -(-args.replays // max(1, len(configs)))  # replays per schedule, spread
    dbo_per_config = -(-args.dbo_iters // max(1, len(configs)))
    only = wanted
    stop = threading.Event()

    def rank_main(rank: Any) -> None:
        ctx = Ctx(rank.rank, W, device, args.out, deadline, comm=rank)
        ctx.results.update(errors=[])
        reg = Registry(args.modules, rank, device, programs=args.programs)

        def section(name: str, body: Any) -> None:
            if name not in only or stop.is_set():
                return
            t0 = time.monotonic()
            marks = {k: len(ctx.results.setdefault(k, [])) for k in PER_RANK}
            status = "ok"
            try:
                body()
            except GpuStuck as exc:
                ctx.error(name, "section", exc)
                status = "gpu stuck"
                stop.set()
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                ctx.error(name, "section", exc)
                status = "error"
            mine = {k: ctx.results[k][marks[k]:] for k in PER_RANK}
            everyone = all_gather_objects(ctx, mine)
            if rank.rank == 0:
                _merge(out, everyone)
                for key in ("latency", "latency_guard_off", "kv", "floor_us", "peer_copy"):
                    if key in ctx.results:
                        out[key] = ctx.results[key]
                out["sections"][name] = {"status": status,
                                         "seconds": round(time.monotonic() - t0, 1)}
                save()
            if status == "gpu stuck":
                raise GpuStuck(f"W={W} section {name}: gpu stuck")

        section("correctness", lambda: correctness(ctx, reg, heads, args.tokens, ["local"]))
        section("graphs", lambda: graphs(ctx, reg, configs, per_config, "local"))
        lat_heads = [h for h in args.latency_heads if h % W == 0]
        section("latency", lambda: bench_all(ctx, reg, lat_heads, args.tokens, args.iters,
                                             args.reps, [1, 16], "local"))
        def guard_cost() -> None:  # the run-time guard off: the same benchmarks
            saved = ctx.results.pop("latency", [])
            off = Registry(args.modules, rank, device, programs=args.programs,
                           extra={"guard": False})
            try:
                bench_all(ctx, off, heads[:1], [8, 512], args.iters, args.reps, [], "local")
                ctx.results["latency_guard_off"] = ctx.results.pop("latency", [])
            finally:
                ctx.results["latency"] = saved
                off.close_all()

        section("guard", guard_cost)
        section("dbo", lambda: [dbo(ctx, reg, h, t, dbo_per_config, False, "local")
                                for h, t in configs])
        if rank.rank == 0 and "residency" not in out:
            out["residency"] = residency(device)
            out["programs"] = {name: {s: t.programs for s, t in inst._tune.items()}
                               for (name, h, _), inst in reg.instances.items() if h in
                               (None, heads[0] if heads else None)}
        barrier(ctx)
        reg.close_all()

    group.run(rank_main, timeout_s=max(30.0, limit))


def summary(results: dict[str, Any]) -> str:
    lines = []
    for W, r in results["worlds"].items():
        parts = []
        for key in ("correctness", "graphs", "dbo"):
            recs = r.get(key, [])
            parts.append(f"{key} {sum(bool(x.get('ok')) for x in recs)}/{len(recs)}")
        reps = sum(x.get("replays", 0) for x in r.get("graphs", []) if x.get("ok"))
        its = sum(x.get("iters", 0) for x in r.get("dbo", []) if x.get("ok"))
        lines.append(f"W={W}: " + ", ".join(parts) + f"; clean replays {reps} (rank records), "
                     f"clean DBO iterations {its}; errors {len(r.get('errors', []))}; "
                     + " ".join(f"{k}={v['status']}/{v['seconds']}s"
                                for k, v in r["sections"].items()))
    host = results.get("host", {})
    for row in host.get("methods", []):
        lines.append(f"host {row['schedule']}.{row['method']}: {row.get('host_us', 0):.1f} us "
                     f"(Triton's launch {row.get('host_us_triton_launch', 0):.1f}), "
                     f"guard off {row.get('host_us_guard_off', 0):.1f} us (anchor "
                     f"{row['anchor']}: {row['anchor_us'] or float('nan'):.1f} us)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out or Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + args.deadline
    args.hard_deadline = deadline
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ctx0 = Ctx(0, 1, device, args.out, deadline)
    meta = metadata(ctx0, sys.argv)
    meta.update(world="one GPU, W ranks as threads (backend local)",
                cuda_module_loading=os.environ.get("CUDA_MODULE_LOADING"),
                label="ONE-DEVICE timings: every peer is the same GPU (no NVLink)")
    results: dict[str, Any] = {"meta": meta, "worlds": {}, "settings": vars(args) | {
        "modules": str(args.modules), "out": str(args.out)}}
    lock = threading.Lock()

    def save() -> None:
        with lock:
            try:
                from benchmarks.report.one_gpu import render

                write_json(args.out / "one_gpu_results.json", results)
                (args.out / "one_gpu_results.md").write_text(render(results))
            except Exception as exc:  # noqa: BLE001 - writing must not kill the run
                print(f"could not write results: {type(exc).__name__}: {exc}", flush=True)

    def watchdog() -> None:  # a hang must still leave its results
        while time.monotonic() < deadline + 25.0:
            time.sleep(1.0)
        results["status"] = "hard deadline exceeded (a hang?)"
        save()
        print(summary(results), flush=True)
        os._exit(124)

    threading.Thread(target=watchdog, daemon=True).start()
    only = set(SECTIONS) if args.only == "all" else set(args.only.split(","))
    if "host" in only:
        from benchmarks.sections.host_overhead import host_overhead

        try:
            results["host"] = host_overhead(args.modules, device)
        except Exception as exc:  # noqa: BLE001
            results["host"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
        print(f"[{time.monotonic() - t0:5.0f}s] host overhead done", flush=True)
    # phase 1: correctness, graphs, latency at every W; phase 2: DBO at every W (last: a
    # hang there would end the run, and spinning kernels would spoil what came after)
    phases = [(only - {"dbo", "host"}, 0.8), (only & {"dbo"}, 1.0)]
    weight = {W: W + 4 for W in args.worlds}
    for wanted, until in phases:
        if not wanted or "status" in results:
            continue
        phase_end = t0 + until * (deadline - t0)
        for i, W in enumerate(args.worlds):
            left = sum(weight[w] for w in args.worlds[i:])
            share = time.monotonic() + (phase_end - time.monotonic()) * weight[W] / left
            if share - time.monotonic() < 10:
                results["worlds"].setdefault(str(W), {"sections": {}})["skipped"] = "deadline"
                continue
            try:
                run_world(args, W, results, share, save, wanted)
            except Exception as exc:  # noqa: BLE001 - recorded; a hang ends the run
                results["worlds"].setdefault(str(W), {"sections": {}})["error"] = \
                    str(exc)[:3000]
                save()
                if "did not finish" in str(exc) or "stuck" in str(exc):
                    results["status"] = f"stopped at W={W}: {str(exc)[:300]}"
                    break
            print(f"[{time.monotonic() - t0:5.0f}s] W={W} {sorted(wanted)} done", flush=True)
    results.setdefault("status", "done")
    results["seconds"] = round(time.monotonic() - t0, 1)
    save()
    print(summary(results), flush=True)
    sys.stdout.flush()
    os._exit(0)  # threads of a hung W may still spin: never wait for them


if __name__ == "__main__":
    sys.exit(main())
