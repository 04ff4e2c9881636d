"""``persist: true`` (a buffer carried from call to call, schedules/ops/persist.yaml): no
read-before-write for its reads, races across calls named with both calls, the located
errors of bad combinations, the float64 reference's carry, the module's contract, and
runs on the local and torch backends against float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.schedules import diagnostics, run_clean

from dcpc import pipeline
from dcpc.harness.simulate import persistent_start, simulate_call
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
PERSIST = ROOT / "schedules" / "ops" / "persist.yaml"
TEXT = PERSIST.read_text()


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def _value_col(text: str, line: int, key: str) -> int:
    """The column (1-based) of ``key``'s value on ``line``."""
    row = text.splitlines()[line - 1]
    return row.index(key) + len(key) + 3  # past "key: "


def test_the_file_is_proved_and_without_persist_its_reads_read_nothing(tmp_path: Path) -> None:
    assert diagnostics(TEXT, tmp_path) == []
    found = diagnostics(TEXT.replace(", persist: true", ""), tmp_path)
    rbw = sorted(d.message for d in found if d.code == "read-before-write")
    assert len(rbw) == 2, found
    assert "'inbox'" in rbw[1] and "'last'" in rbw[0], rbw


def test_two_calls_in_flight_race_on_it_naming_both_calls(tmp_path: Path) -> None:
    """Two slots on their own streams: call 1 reads what call 0 may still be writing."""
    found = diagnostics(TEXT.replace("streams: single\n", ""), tmp_path, worlds=(2,))
    races = [d.message for d in found if d.code == "race"]
    assert any(m.startswith("read-after-write race on inbox: take on rank 0 (call 1)")
               and "hand on rank 1 (call 0)" in m for m in races), races
    assert any(m.startswith("read-after-write race on last: recall on rank 0 (call 1)")
               and "keep on rank 0 (call 0)" in m for m in races), races


def test_a_peer_s_next_write_races_the_read_without_the_barrier(tmp_path: Path) -> None:
    found = diagnostics(TEXT.replace("  - free:   {op: barrier}\n", ""), tmp_path,
                        worlds=(2,))
    races = [d for d in found if d.code == "race"]
    assert any(d.message.startswith("write-after-read race on inbox: hand on rank 1")
               and "take on rank 0" in d.message for d in races), races
    assert all(d.code == "race" for d in found if d.severity == "error"), found


def test_persist_on_an_engine_buffer_is_located(tmp_path: Path) -> None:
    text = TEXT.replace("x:         {shape: [N, D], dtype: bf16}",
                        "x:         {shape: [N, D], dtype: bf16, persist: true}")
    found = [d for d in diagnostics(text, tmp_path) if d.code == "persist-engine-owned"]
    assert len(found) == 1, found
    line = _line(text, "x: ")
    assert (found[0].mark.line, found[0].mark.col) == (line, _value_col(text, line, "persist"))
    assert "buffer 'x'" in found[0].message and "symmetric: true" in (found[0].hint or "")


def test_persist_with_a_size_bound_per_call_is_located(tmp_path: Path) -> None:
    text = TEXT.replace("  N: 16\n", "  N: {max: 16}\n")
    found = [d for d in diagnostics(text, tmp_path) if d.code == "persist-size"]
    assert sorted(d.mark.line for d in found) == [_line(text, "inbox: "), _line(text, "last: ")]
    assert all("names N, a size bound per call" in d.message for d in found), found


def test_the_reference_carries_it_from_call_to_call() -> None:
    """Call 0 reads zeros; call 1 reads what call 0 left: the previous rank's x in
    inbox, this rank's own x in last."""
    schedule = parse_file(PERSIST)
    sizes, world = {"N": 16, "D": 40}, 3
    xs = [[{"x": torch.randn(16, 40, dtype=torch.float64).bfloat16().double()}
           for _ in range(world)] for _ in range(2)]
    end = None
    for call in range(2):
        inputs = [{**x, **start} for x, start in zip(
            xs[call], persistent_start(schedule, world, sizes, end), strict=True)]
        end = simulate_call(schedule, world, sizes, inputs, external=None)  # type: ignore[arg-type]
        for r in range(world):
            if call == 0:
                assert not end[r]["from_prev"].any() and not end[r]["mine_before"].any()
            else:
                assert torch.equal(end[r]["from_prev"], xs[0][(r - 1) % world]["x"])
                assert torch.equal(end[r]["mine_before"], xs[0][r]["x"])
            assert torch.equal(end[r]["inbox"], xs[call][(r - 1) % world]["x"])


def test_the_module_allocates_it_once_and_says_it_persists() -> None:
    text = pipeline.run(PERSIST, pipeline.Options(worlds=(2,)), until="emit").module_text
    assert text is not None
    assert text.count("persist=True") == 2, text
    said = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    for name in ("inbox", "last"):
        assert f"{name} persists: one instance for all slots, zeros at construction" in text
        # a reset: every rank together, no peer's call in flight, after the warm-up calls
        assert (f"write module.buffer('{name}') on every rank, all ranks together, while "
                "no call of any peer is in flight") in said, said
    assert said.count("advance it: reset after warm-up") == 2, said


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local", "torch"])
def test_it_runs_against_float64(backend: str) -> None:
    """Five calls over two slots: every call's reads of the previous call's values match."""
    report, text = run_clean(schedule=str(PERSIST), world=2, backend=backend, calls=5)
    for name in ("from_prev", "mine_before", "inbox", "last"):
        assert report.outputs[name].compared == 10, text  # type: ignore[attr-defined]


CHANGES = pytest.mark.parametrize("change", [
    ("", ""),
    ("streams: single\n", ""),
    ("  - free:   {op: barrier}\n", ""),
], ids=["proved", "two_streams", "no_barrier"])


@CHANGES
def test_the_execution_oracle_agrees(change: tuple[str, str]) -> None:
    """The oracle runs the plan's slots and epochs on one instance per rank of each
    persistent buffer (the local one too): it finds the races the checker reports, and
    none in the proved file."""
    from support.exec_oracle_agree import disagreements

    from dcpc.lang.parse import parse_text

    schedule = parse_text(TEXT.replace(*change), "persist.yaml")
    found = disagreements(schedule, (2, 3), runs=lambda world: {
        "policies": ("lockstep", "hold"), "randoms": 2, "seed": world})
    assert not found, "\n".join(found)


@CHANGES
def test_the_brute_force_agrees(change: tuple[str, str]) -> None:
    """tests/support/hb_oracle.py's unrolled graph has one instance per rank of each
    persistent buffer for all slots, the local 'last' too (it tracked symmetric ones
    only, per slot, and so missed the races on 'last' of two calls in flight), and
    reads of one before the call writes it are no read-before-write."""
    from support.hb_oracle import oracle_keys, oracle_unwritten

    from dcpc.check import hb
    from dcpc.lang.parse import parse_text

    schedule = parse_text(TEXT.replace(*change), "persist.yaml")
    for world in (2, 3):
        keys = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert oracle_keys(schedule, world) == keys, world
        assert oracle_unwritten(schedule, world) == set(), world
        assert bool(keys) == bool(change[0]), keys


@pytest.mark.e2e
def test_the_kernels_touch_what_the_plan_says() -> None:
    """Traced (every kernel's loads and stores against the plan's effects, the one local
    instance of 'last' and the one symmetric 'inbox' per rank for both slots)."""
    from dcpc.harness import trace as tr

    run = tr.run_traced(str(PERSIST), 2, programs=1, block=None, calls=3)
    assert run.mismatches == 0 and run.problems == [], run.problems
    assert run.trace.calls and run.trace.raw


def test_a_persistent_buffer_no_step_writes_is_read_before_write(tmp_path: Path) -> None:
    text = TEXT.replace("  - hand:   {op: shift, src: x, dst: inbox, offset: next}\n", "")
    found = [d for d in diagnostics(text, tmp_path) if d.severity == "error"]
    assert [(d.code, d.mark.line, d.message) for d in found] == [(
        "read-before-write", _line(text, "take:"), "step 'take' reads persistent buffer "
        "'inbox', but no step writes it: it holds its initial zeros in every call")], found


@pytest.mark.e2e
def test_the_race_across_calls_replayed_shows_the_stale_read(tmp_path: Path) -> None:
    """The two-streams variant's first race (call 1's take may read inbox before rank
    1's hand of call 0 wrote it), replayed: the hold makes call 1 read call -1's value."""
    import subprocess
    import sys

    from dcpc.harness.replay import plan
    from dcpc.harness.run import RunConfig, format_report, run_schedule

    twin = tmp_path / "two_streams.yaml"
    twin.write_text(TEXT.replace("streams: single\n", ""))
    done = subprocess.run([sys.executable, "-m", "dcpc", "check", str(twin), "--world", "2",
                           "--format", "json"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    (tmp_path / "race.json").write_text(done.stdout)
    replay = plan(str(tmp_path / "race.json"), str(twin), None)
    report = run_schedule(RunConfig(schedule=str(twin), world=2, backend="host",
                                    calls=replay.calls, wait_timeout_s=240, replay=replay))
    text = format_report(report)
    assert report.replay_outcome.startswith("released"), text
    first = report.outputs["from_prev"].first_mismatch
    assert first.startswith("call 1 slot 0 rank 0 (take)"), text


def test_an_interleaved_run_keeps_the_simulations_of_the_calls_in_flight_only() -> None:
    """Interleaved order (seed 29) runs all of call 5 before call 4 starts: call 4 is
    simulated for call 5's start and kept until it ran (it was dropped, and the run
    simulated calls 5, 6, 7, ... for it forever); at most slots + 1 calls kept."""
    from dcpc.harness import adversary
    from dcpc.harness.worker import CallSims
    from dcpc.lang.parse import parse_text

    schedule = parse_text(TEXT.replace("streams: single\n", ""), "two_streams.yaml")
    events = adversary.plan_events(schedule, 12, "interleaved", 29)
    starts = [e.call for e in events if e.step == 0]
    assert starts.index(5) < starts.index(4), starts  # the order this test is about
    sims = CallSims(schedule, 2, {}, 29, None)
    last = len(schedule.step_list()) - 1
    ran = []
    for event in events:
        if event.step == 0:
            sims.get(event.call)
        if event.step == last:
            sims.finish(event.call)
            ran.append(event.call)
    assert sorted(ran) == list(range(12)) and max(sims.sims) == 11
    assert sims.most <= schedule.slots + 1, sims.most
    assert len(sims.sims) == 1  # the last call's end only


@pytest.mark.e2e
def test_an_interleaved_run_of_two_streams_finishes() -> None:
    """``dcpc run`` of the two-streams variant, interleaved (seed 29: call 5 before call
    4): every call runs (before, the run hung, its memory growing)."""
    import tempfile

    from dcpc.harness.run import RunConfig, run_schedule

    with tempfile.TemporaryDirectory() as tmp:
        twin = Path(tmp) / "two_streams.yaml"
        twin.write_text(TEXT.replace("streams: single\n", ""))
        report = run_schedule(RunConfig(schedule=str(twin), world=2, backend="local",
                                        calls=6, seed=29, order="interleaved"))
    assert report.launch.ok
    for name in ("from_prev", "mine_before", "inbox", "last"):
        assert report.outputs[name].compared == 12, name  # type: ignore[attr-defined]


def test_a_persistent_buffer_no_step_writes_on_a_rank_is_read_before_write_there(
        tmp_path: Path) -> None:
    """Rank by rank: a read on rank r needs a step that writes it on r in some call. The
    gallery's stage 0 without the guard of 'layers' would run its layers on zeros (the
    wrap: false send reaches no stage 0); a guarded 'keep' leaves rank 0's 'last' zeros."""
    gallery = (ROOT / "schedules" / "gallery" / "pipeline_clock_cycles.yaml").read_text()
    text = gallery.replace('  - layers: {op: external, when: "rank > 0", ',
                           "  - layers: {op: external, ")
    assert text != gallery
    found = [d for d in diagnostics(text, tmp_path) if d.severity == "error"]
    line = _line(text, "- layers:")
    assert [(d.code, d.mark.line, d.message) for d in found] == [(
        "read-before-write", line, f"step 'layers' reads persistent buffer '{name}' on rank "
        f"0 at W=2, but no step writes it there: the store of '{send}' does not reach it "
        "(a shift without wrap: no source on that side of the line), so it holds its "
        "initial zeros in every call there") for name, send in (
            ("inbox_hidden", "send_hidden"), ("inbox_residual", "send_residual"))], found
    text = TEXT.replace("dst: last}", 'dst: last, when: "rank > 0"}')
    found = [d for d in diagnostics(text, tmp_path) if d.severity == "error"]
    assert [(d.code, d.mark.line, d.message) for d in found] == [(
        "read-before-write", _line(text, "recall:"), "step 'recall' reads persistent buffer "
        "'last' on rank 0 at W=2, but no step writes it there: 'keep' does not run there "
        "(its when: does not hold), so it holds its initial zeros in every call there")]


SPLIT_GUARDED = """\
schedule: persist_split_guarded
slots: 1
streams: single
sizes:
  N: 16
  D: 40
buffers:
  x:         {shape: [N, D], dtype: bf16}
  inbox:     {shape: [N, D], dtype: bf16, symmetric: true, persist: true}
  from_prev: {shape: [N, D], dtype: bf16}
steps:
  - take:   {op: copy, src: inbox, dst: from_prev%s}
  - free:   {op: barrier}
  - put: {op: shift, when: "rank < W - 1", src: x, dst: inbox, offset: next, wrap: false,
          phase: put}
  - wait: {op: shift, when: "rank > 0", src: x, dst: inbox, offset: next, wrap: false,
           phase: wait}
  - done:   {op: barrier}
"""


def test_a_split_put_s_store_is_where_its_wait_runs(tmp_path: Path) -> None:
    """A put and its wait guarded apart: the store lands at the wait, so a read on a rank
    where the wait does not run (rank 0) reads zeros, and the message names the wait,
    not the put (which does run on rank 0)."""
    assert [d for d in diagnostics(SPLIT_GUARDED % ', when: "rank > 0"', tmp_path)
            if d.severity == "error"] == []
    found = [d for d in diagnostics(SPLIT_GUARDED % "", tmp_path) if d.severity == "error"]
    assert [(d.code, d.message) for d in found] == [(
        "read-before-write", "step 'take' reads persistent buffer 'inbox' on rank 0 at W=2, "
        "but no step writes it there: 'wait' (the wait where the store of 'put' lands) does "
        "not run there (its when: does not hold), so it holds its initial zeros in every "
        "call there")], found
