"""`dcpc run` of rank-dependent steps (`when:`) on the torch backend (gloo): the host
backend runs them in tests/cli/test_gallery.py (zigzag at W 2, 3, 4) and
tests/ops/test_op_schedules.py (schedules/ops/when.yaml at W 2, 3). Every output matches
float64, and each guarded engine step's reads are compared on exactly the ranks where its
condition holds (the module's runs() and the reference agree on where it runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.gallery import CALLS, worlds

from dcpc.harness.run import RunConfig, format_report, run_schedule

ROOT = Path(__file__).resolve().parents[2]
ZIGZAG = ROOT / "schedules" / "gallery" / "zigzag_ring_attention.yaml"
OPS_WHEN = ROOT / "schedules" / "ops" / "when.yaml"


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_runs_on_torch_against_float64(world: int) -> None:
    report = run_schedule(RunConfig(schedule=str(ZIGZAG), world=world, backend="torch",
                                    calls=CALLS, seed=33))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    # ring step s = h + 1: the upper branch (s > r) on ranks 0..s-1, the lower (s <= r)
    # on ranks s..W-1; the last step (s = W - 1) likewise. The upper reads the whole slot
    # recv_k[h % 2] (what the shift returns), the lower its first chunk recv_k[h % 2][:, 0]
    # (a view of the slot, compared at each read)
    chunk_reads = {0: 0, 1: 0}
    for h in range(world - 1):
        s, slot = h + 1, h % 2
        step = "last" if h == world - 2 else f"h{h}"
        for kv in ("k", "v"):
            assert report.outputs[f"recv_{kv}_{slot}@attend_upper_{step}"].compared == \
                CALLS * s, text
        chunk_reads[slot] += world - s
    for slot, reads in chunk_reads.items():
        for kv in ("k", "v"):
            name = f"recv_{kv}_{slot}_0"
            assert (report.outputs[name].compared if reads else 0) == CALLS * reads, text


@pytest.mark.e2e
def test_guarded_kernels_run_on_torch_against_float64() -> None:
    """schedules/ops/when.yaml: a guarded copy, sum and merges return without launching
    on the odd ranks; what they return there is what they held (nothing to compare)."""
    report = run_schedule(RunConfig(schedule=str(OPS_WHEN), world=3, backend="torch",
                                    calls=CALLS, seed=33))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    # ranks 0 and 2 run every step (rank < W - 1 keeps sum off rank 2), rank 1 none
    assert report.outputs["x_copy"].compared == CALLS * 2, text
    assert report.outputs["y"].compared == CALLS * 1, text
    assert report.outputs["out"].compared == CALLS * 2, text


OPS_COMM = ROOT / "schedules" / "ops" / "when_communication.yaml"
OPS_COMM_AXIS = ROOT / "schedules" / "ops" / "when_communication_axis.yaml"


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "local"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_guarded_exchanges_run_against_float64(backend: str, world: int) -> None:
    """schedules/ops/when_communication.yaml (the host backend: tests/ops): the swap runs
    on ranks 0 and 1 only, the hand-off's wait on ranks 1.. W-1; a skipped step returns
    what its buffer held (not compared) and shifts no signal epoch of the steps after."""
    report = run_schedule(RunConfig(schedule=str(OPS_COMM), world=world, backend=backend,
                                    calls=CALLS, seed=19))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert report.outputs["recv"].compared == CALLS * 2, text
    assert report.outputs["hand"].compared == CALLS * (world - 1), text
    assert report.outputs["s"].compared >= CALLS * world, text


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "local"])
@pytest.mark.parametrize("shape", worlds("2x2 2x3"), ids=str)
def test_guarded_team_collectives_run_against_float64(backend: str, shape: int) -> None:
    """schedules/ops/when_communication_axis.yaml: node 0's teams gather along gpu, the
    teams of gpu 0 reduce along node, the others skip together."""
    nodes, gpus = shape.shape  # type: ignore[attr-defined]
    report = run_schedule(RunConfig(schedule=str(OPS_COMM_AXIS), world=shape,
                                    backend=backend, calls=CALLS, seed=19))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert report.outputs["x_node"].compared == CALLS * gpus, text
    assert report.outputs["x_sum"].compared == CALLS * nodes, text


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "local"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_one_loop_ring_runs_against_float64(backend: str, world: int) -> None:
    """schedules/ops/when_ring_attention.yaml: the last hop's send and its wait are
    skipped on every rank (at W = 2 the only other hop), the first hop initialises."""
    path = ROOT / "schedules" / "ops" / "when_ring_attention.yaml"
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend=backend,
                                    calls=CALLS, seed=19))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert report.outputs["recv_1@attend_h1"].compared == CALLS * world, text


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "local"])
def test_ragged_exchanges_guarded_by_node_run_against_float64(tmp_path: Path,
                                                              backend: str) -> None:
    """schedules/ops/ragged_all_to_all_axis.yaml with every step along gpu (and the
    engine steps around them) guarded by `node == 0`: node 1's teams skip the ragged
    exchanges together (the float64 reference runs no op for a team that skips it,
    whose counts nothing wrote) and the rail along node still runs everywhere."""
    import re

    text = (ROOT / "schedules" / "ops" / "ragged_all_to_all_axis.yaml").read_text()
    text, n = re.subn(r"(- (route|nvlink|back|cast|use):\s+\{op: [a-z_]+,)",
                      r'\1 when: "node == 0",', text)
    assert n == 5
    path = tmp_path / "ragged_when.yaml"
    path.write_text(text)
    report = run_schedule(RunConfig(schedule=str(path), world=worlds("2x2")[0],
                                    backend=backend, calls=CALLS, seed=19))
    out = format_report(report)
    assert report.launch.ok, out
    assert report.mismatches == 0, out
    assert report.outputs["q_recv"].compared == CALLS * 2, out  # node 0's two ranks


SIGWAIT = """\
schedule: sigwait_run
slots: 2
sizes: {T: {max: 8}, D: 8}
buffers:
  x:   {shape: [T, D], dtype: f32}
  g:   {shape: [W*T, D], dtype: f32, symmetric: true}
  out: {shape: [T, D], dtype: f32}
steps:
  - go:     {op: signal, to: next, channel: c, when: "rank < W - 1"}
  - got:    {op: wait, from: prev, channel: c, when: "rank > 0"}
  - gather: {op: all_gather, src: x, dst: g}
  - use:    {op: external, when: "rank > 0", reads: [g], writes: [out]}
  - done:   {op: barrier}
"""


def _proved(path: Path, world: object) -> None:
    """The file passes every check at ``world`` (a run of a refused file proves nothing)."""
    from dcpc import pipeline

    pipeline.run(path, pipeline.Options(worlds=[world]), until="hb")


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "local"])
def test_a_signal_and_wait_guarded_by_rank_run(tmp_path: Path, backend: str) -> None:
    """A signal sent where a next rank exists and its wait where a previous one does
    (rank 0 never waits): on torch the wait is a barrier over ranks 1..W-1 only (its
    runners' own group per slot), not over the group, which would wait for rank 0."""
    path = tmp_path / "sigwait.yaml"
    path.write_text(SIGWAIT)
    _proved(path, 3)
    report = run_schedule(RunConfig(schedule=str(path), world=3, backend=backend,
                                    calls=CALLS, seed=19))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert report.outputs["g@use"].compared == CALLS * 2, text


PERM_AXIS = """\
schedule: perm_axis_run
mesh: {node: N, gpu: G}
sizes: {N: {max: 4}, G: {max: 4}, T: {max: 8}, D: 8}
buffers: {x: {shape: [T, D], dtype: f32}, hand: {shape: [T, D], dtype: f32, symmetric: true},
          out: {shape: [T, D], dtype: f32}}
steps:
  - swap: {op: shift, axis: node, when: "node < 2", src: x, dst: hand, perm: "r + 1 - 2 * (r % 2)"}
  - use:  {op: external, when: "node < 2", reads: [hand], writes: [out]}
  - done: {op: barrier, axis: node}
"""


@pytest.mark.e2e
def test_a_guarded_axis_shift_runs_on_per_axis_backends(tmp_path: Path) -> None:
    """A swap along node run by nodes 0 and 1 of three, node on torch and gpu on host:
    the torch step's settle (its team's writes all land before any member returns) is a
    barrier over the team's members that run it, not the team (node 2 skips it)."""
    path = tmp_path / "permaxis.yaml"
    path.write_text(PERM_AXIS)
    _proved(path, worlds("3x2")[0])
    report = run_schedule(RunConfig(schedule=str(path), world=worlds("3x2")[0],
                                    backend={"node": "torch", "gpu": "host"},
                                    calls=CALLS, seed=19))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert report.outputs["hand@use"].compared == CALLS * 4, text  # nodes 0, 1 of 3x2
