"""Every shipped schedule, compiled and run across processes on both CPU backends.

Each configuration runs 8 calls per rank (6 at W = 3) with poisoned symmetric memory,
random delays around every step, slot 1 before slot 0, empty KV shards, CUDA-graph
padding rows and NaN/inf garbage in empty partials; every output of every call on every
rank must match the float64 simulation of the schedule. The calls were 30 (20 at W = 3)
until 2026-12-02: ``test_the_calls_of_every_run_cover_each_input_case`` shows that the
first calls of every configuration already hold the largest and the smallest sizes,
both slots, padding rows and an empty KV shard, so the extra calls repeated cases.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from dcpc.harness.run import RunConfig, format_report, run_schedule

SCHEDULES = Path(__file__).resolve().parents[2] / "schedules"
SHIPPED = sorted(p.stem for p in SCHEDULES.glob("*.yaml"))
CALLS = {2: 8, 3: 6}  # per rank, by W (the coverage test below: what these calls hold)

INTERLEAVED_CALLS = 8  # four pairs of calls in flight (was 20)
BASE2_CALLS = 8  # (was 20)

pytestmark = pytest.mark.e2e


def _run(config: RunConfig) -> None:
    report = run_schedule(config)
    text = format_report(report)
    print(text)
    assert report.launch.ok, text + "\n" + "\n".join(o.traceback for o in report.launch.outcomes)
    assert report.mismatches == 0, text
    for name, stats in report.outputs.items():
        assert stats.compared == config.calls * config.world, (name, text)


@pytest.mark.parametrize("backend", ["host", "torch"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("schedule", SHIPPED)
def test_shipped_schedule_matches_float64_reference(schedule: str, world: int,
                                                    backend: str) -> None:
    seed = zlib.crc32(f"{schedule}/{world}/{backend}".encode()) % 10_000
    _run(RunConfig(schedule=str(SCHEDULES / f"{schedule}.yaml"), world=world, backend=backend,
                   calls=CALLS[world], seed=seed))


@pytest.mark.parametrize("schedule", ["kimi_k3_dcp", "kimi_k3_dcp_fused", "kimi_k3_dcp_ag_rs"])
def test_two_slots_in_flight_interleaved(schedule: str) -> None:
    _run(RunConfig(schedule=str(SCHEDULES / f"{schedule}.yaml"), world=2, backend="host",
                   calls=INTERLEAVED_CALLS, seed=11, order="interleaved"))


@pytest.mark.parametrize("backend", ["host", "torch"])
@pytest.mark.parametrize("schedule", ["kimi_k3_dcp", "kimi_k3_dcp_fused", "kimi_k3_dcp_ag_rs"])
def test_base2_lse_variant(schedule: str, backend: str) -> None:
    _run(RunConfig(schedule=str(SCHEDULES / f"{schedule}.yaml"), world=2, backend=backend,
                   calls=BASE2_CALLS, seed=23, lse_base="2"))


@pytest.mark.parametrize("world", [2, 3])
def test_fused_exchange_with_a_reader_of_via(tmp_path: Path, world: int) -> None:
    """The fused op copies its own part into via[rank] when a later step reads via
    (the shipped schedule does not, and merges its own part from src instead)."""
    text = (SCHEDULES / "kimi_k3_dcp_fused.yaml").read_text()
    variant = tmp_path / "fused_via_read.yaml"
    variant.write_text(text.replace("schedule: kimi_k3_dcp_fused", "schedule: fused_via_read")
                       + "  - inspect:      {op: external, reads: [o_recv, lse_recv]}\n")
    _run(RunConfig(schedule=str(variant), world=world, backend="host", calls=12, seed=41,
                   programs=2))
    if world == 2:  # mutation: skip the own part anyway; the reader of via must notice
        report = run_schedule(RunConfig(schedule=str(variant), world=2, backend="host",
                                        calls=4, seed=41, module_patch=(
                                            ("FROM_SRC=-1,", "FROM_SRC=self.rank,"),)))
        assert report.launch.ok and report.outputs["o_recv"].mismatches > 0, \
            format_report(report)
        assert report.outputs["out"].mismatches == 0, format_report(report)


@pytest.mark.parametrize("world", [2, 3])
def test_fused_exchange_with_one_program(world: int) -> None:
    """One program pushes every tile of the fused exchange, so every call with more than
    one tile runs as two launches (push + signal + wait, then the merge)."""
    _run(RunConfig(schedule=str(SCHEDULES / "kimi_k3_dcp_fused.yaml"), world=world,
                   backend="host", calls=8, seed=43, programs=1))


def test_several_programs_per_kernel() -> None:
    _run(RunConfig(schedule=str(SCHEDULES / "kimi_k3_dcp_ag_rs.yaml"), world=2, backend="host",
                   calls=6, seed=31, programs=4))


def test_a_module_without_waits_is_caught() -> None:
    """Mutation: waits that never wait. The harness must see wrong or poisoned values."""
    no_wait = (("    if _dcpc_count(pending) > 0:\n        got = _dcpc_spin(",
                "    if False:\n        got = _dcpc_spin("),
               ("    if (_dcpc_count(bad) > 0) | (tl.load(errors, volatile=True) != 0):\n",
                "    if False:\n"))
    report = run_schedule(RunConfig(schedule=str(SCHEDULES / "kimi_k3_dcp.yaml"), world=2,
                                    backend="host", calls=12, seed=5, jitter_s=0.02,
                                    jitter_p=0.8, module_patch=no_wait))
    print(format_report(report))
    assert report.mismatches > 0, format_report(report)


ENGINE_SCHEDULES = Path(__file__).resolve().parents[1] / "engine_schedules"


@pytest.mark.parametrize("backend,world", [("host", 3), ("torch", 2)])
@pytest.mark.parametrize("schedule", sorted(p.stem for p in ENGINE_SCHEDULES.glob("*.yaml")))
def test_engine_input_schedules(schedule: str, backend: str, world: int) -> None:
    """Local lengths [B, W], an fp8 output with output_scale, fp32 through a reduce_scatter
    into a narrower dst: the kernels and the torch backend against the simulation."""
    _run(RunConfig(schedule=str(ENGINE_SCHEDULES / f"{schedule}.yaml"), world=world,
                   backend=backend, calls=8, seed=5, order="interleaved"))


def _configurations() -> list[tuple[str, int, int, int, str]]:
    """(schedule, world, calls, seed, order) of every run above with synthetic inputs."""
    out = [(s, w, CALLS[w], zlib.crc32(f"{s}/{w}/{b}".encode()) % 10_000, "sequential")
           for s in SHIPPED for w in (2, 3) for b in ("host", "torch")]
    fused = ["kimi_k3_dcp", "kimi_k3_dcp_fused", "kimi_k3_dcp_ag_rs"]
    out += [(s, 2, INTERLEAVED_CALLS, 11, "interleaved") for s in fused]
    return out + [(s, 2, BASE2_CALLS, 23, "sequential") for s in fused]


def test_the_calls_of_every_run_cover_each_input_case() -> None:
    """What the fewer calls must still hold, per configuration: every per-call size at its
    maximum and at 1, both slots, and (for a schedule with a mask) a call with CUDA-graph
    padding rows and a call where some rank holds an empty KV shard for a real row (the
    rows whose partials the synthetic attention fills with NaN/inf garbage)."""
    from dcpc.harness import adversary, synth
    from dcpc.harness.simulate import empty_rows
    from dcpc.lang.parse import parse_file

    for name, world, calls, seed, order in _configurations():
        schedule = parse_file(SCHEDULES / f"{name}.yaml")
        ctor = synth.constructor_sizes(schedule, world)
        mask = synth.mask_of(schedule)
        seen: dict[str, set[int]] = {k: set() for k in synth.runtime_sizes(schedule)}
        padded = empty = 0
        for call in range(calls):
            sizes = synth.call_sizes(schedule, world, ctor, seed, call)
            for k in seen:
                seen[k].add(sizes[k])
            if mask is None:
                continue
            inputs = synth.call_inputs(schedule, world, sizes, seed, call)
            real = int(inputs[0][mask.query_start_loc][-1])
            padded += real < sizes["T"]
            empty += any(bool(empty_rows(mask, inputs[r], r, world, sizes["T"])[:real].any())
                         for r in range(world))
        where = f"{name} W={world} seed {seed}, {calls} calls"
        for k, values in seen.items():
            assert {1, ctor[k]} <= values, (where, k, values)
        slots = {e.slot for e in adversary.plan_events(schedule, calls, order, seed)}
        assert slots == set(range(schedule.slots)), (where, slots)
        if mask is not None:
            assert padded >= 1 and empty >= 1, (where, padded, empty)
