"""The ``local`` backend on CPU: W ranks as threads of one process (Triton interpreter).

Every shipped schedule at W = 2 and 4, run for real in one child process: poisoned
symmetric memory, seeded delays around every step, slots in flight interleaved, empty
shards, padding rows and NaN/inf garbage in empty partials (dcpc.harness builds the
inputs); every value a method returns is compared with the float64 simulation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import pytest

SCHEDULES = Path(__file__).resolve().parent.parent / "schedules"
SHIPPED = sorted(p.stem for p in SCHEDULES.glob("*.yaml"))

pytestmark = pytest.mark.e2e


def _rank_main(rank: Any, module_path: str, schedule_path: str, calls: int, seed: int,
               order: str) -> dict[str, Any]:
    """One rank: the harness worker's event loop, with a LocalRank as the group."""
    import torch

    from dcpc.harness import adversary, synth
    from dcpc.harness.simulate import simulate_call
    from dcpc.harness.worker import (
        MOVES,
        OutputStats,
        _to_engine,
        compare,
        load_module_class,
        method_arguments,
        returned_names,
    )
    from dcpc.lang import model as m
    from dcpc.lang.parse import parse_file

    schedule = parse_file(schedule_path)
    steps = schedule.step_list()
    world, r = rank.world, rank.rank
    cls = load_module_class(module_path, schedule.schedule)
    ctor = synth.constructor_sizes(schedule, world)
    import inspect

    knobs = {k: v for k, v in {"poison": True, "spin_limit": 1 << 24}.items()
             if k in inspect.signature(cls).parameters}
    module = cls(rank, sizes=ctor, device="cpu", backend="local", **knobs)
    jitter = adversary.Jitter(seed, r, 0.002, 0.3)
    stats: dict[str, OutputStats] = {}
    live: dict[int, Any] = {}
    for event in adversary.plan_events(schedule, calls, order, seed):
        if event.call not in live:
            sizes = synth.call_sizes(schedule, world, ctor, seed, event.call)
            inputs = synth.call_inputs(schedule, world, sizes, seed, event.call)
            external = synth.make_external(schedule, world, sizes, seed, event.call)
            ref = simulate_call(schedule, world, sizes, inputs, external)[r]
            env = {k: _to_engine(schedule, k, v) for k, v in inputs[r].items()}
            live[event.call] = (ref, env, external, sizes)
        ref, env, external, sizes = live[event.call]
        step = steps[event.step]
        jitter.delay()
        where = f"call {event.call} slot {event.slot} rank {r}"
        if isinstance(step.op, m.External):
            for name in step.op.reads:  # module-owned buffers an engine step reads
                if name not in env:
                    got = module.buffer(name, event.slot, sizes)
                    compare(name, "move", schedule.buffers[name].dtype.value, got, ref[name],
                            stats.setdefault(name, OutputStats()), f"{where} ({step.name})")
                    env[name] = got
            seen = {k: v.to(torch.float64) for k, v in env.items()}
            for name, value in external(step, r, seen).items():
                env[name] = _to_engine(schedule, name, value)
        else:
            args = [env[name] for name in method_arguments(cls, step.name)]
            result = getattr(module, step.name)(*args, slot=event.slot)
            values = [] if result is None else list(result) if isinstance(
                result, (tuple, list)) else [result]
            kind = "move" if isinstance(step.op, MOVES) else "math"
            for name, value in zip(returned_names(step.op), values, strict=True):
                env[name] = value
                compare(name, kind, schedule.buffers[name].dtype.value, value, ref[name],
                        stats.setdefault(name, OutputStats()), where)
        jitter.delay()
        if event.step == len(steps) - 1:
            del live[event.call]
    rank.barrier()  # nobody drops its heap while a peer may store into it
    module.close()
    return {k: vars(v) for k, v in stats.items()}


def _fail_child() -> None:
    from dcpc.runtime.local import LocalGroup, LocalRankError

    def body(rank: Any) -> None:
        if rank.rank == 1:
            raise ValueError("rank 1 gives up")
        rank.barrier()

    try:
        LocalGroup(3, "cpu", timeout_s=30).run(body)
    except LocalRankError as exc:
        print("RESULT " + json.dumps(str(exc)))


def _child(schedule: str, world: int, calls: int, seed: int, order: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    from dcpc.harness.run import compile_to
    from dcpc.runtime.local import LocalGroup

    with tempfile.TemporaryDirectory(prefix="dcpc-local-") as tmp:
        used, module, _, _ = compile_to(str(SCHEDULES / f"{schedule}.yaml"), Path(tmp), world)
        group = LocalGroup(world, "cpu", timeout_s=240)
        out = group.run(_rank_main, module, used, calls, seed, order)
    print("RESULT " + json.dumps(out))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", SHIPPED)
def test_local_threads_match_float64(schedule: str, world: int) -> None:
    calls = 6 if world == 2 else 4
    seed = zlib.crc32(f"local/{schedule}/{world}".encode()) % 10_000
    order = "interleaved" if schedule != "kv_gather" else "sequential"
    ranks = _run_child(schedule, str(world), str(calls), str(seed), order)
    assert len(ranks) == world
    for r, outputs in enumerate(ranks):
        assert outputs, f"rank {r} compared nothing"
        for name, s in outputs.items():
            assert s["compared"] > 0 and s["mismatches"] == 0, (r, name, s)


def _run_child(*args: str, timeout: float = 420) -> Any:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_local_rank_failure_is_reported_not_hung() -> None:
    """A rank that raises breaks the group: the others stop at their barrier, and the
    error names the rank and its exception."""
    text = _run_child("--fail", timeout=120)
    assert "rank 1 failed" in text and "rank 1 gives up" in text, text


def test_local_program_cap_on_cpu() -> None:
    import torch

    from dcpc.runtime.local import CPU_PROGRAMS, program_cap

    assert program_cap(torch.device("cpu"), 8, 2) == CPU_PROGRAMS


if __name__ == "__main__":
    if sys.argv[1] == "--fail":
        _fail_child()
        sys.exit(0)
    _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
