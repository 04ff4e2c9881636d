"""broadcast: the verifier, the float64 meaning, the checker's over-approximating model
against the exact brute force (only the root stores), runs on both CPU backends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.hb_oracle import oracle_keys
from support.schedules import write

from dcpc import pipeline
from dcpc.check import hb
from dcpc.diagnostics import DiagnosticError
from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_text

SCHEDULE = """\
schedule: bc
sizes:
  T: {max: 8}
  D: 16
buffers:
  x:   {shape: [T, D], dtype: bf16}
  y:   {shape: [T, D], dtype: bf16, symmetric: true}
steps:
  - make:  {op: external, writes: [x]}
  - send:  {op: broadcast, src: x, dst: y, root: 1}
  - use:   {op: external, reads: [y]}
  - done:  {op: barrier}
"""


@pytest.mark.parametrize("old,new,code,words", [
    ("root: 1}", "root: 2}", "root-out-of-range",
     "step 'send' has root 2, but the group has only 2 ranks at W=2"),
    ("y:   {shape: [T, D], dtype: bf16, symmetric: true}", "y:   {shape: [T, D], dtype: bf16}",
     "not-symmetric", "peers write into dst 'y'"),
    ("y:   {shape: [T, D]", "y:   {shape: [T, 2*D]", "shape-mismatch",
     "dst 'y' of step 'send' has shape [T, 2*D] but must be [T, D]"),
])
def test_refusals(tmp_path: Path, old: str, new: str, code: str, words: str) -> None:
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(write(tmp_path, SCHEDULE.replace(old, new, 1), "bc.yaml"),
                     pipeline.Options(worlds=(2, 3)))
    found = [(d.code, d.mark.line, d.message) for d in err.value.diagnostics]
    assert [(c, line) for c, line, _ in found] == [(code, 10)], found
    assert words in found[0][2], found


def test_the_reference_gives_every_rank_the_roots_src() -> None:
    schedule = parse_text(SCHEDULE, "bc.yaml")
    gen = torch.Generator().manual_seed(1)
    inputs = [{"x": simulate.as_stored(schedule, "x", torch.randn(
        3, 16, generator=gen, dtype=torch.float64))} for _ in range(3)]
    out = simulate.simulate_call(schedule, 3, {"T": 3, "D": 16}, inputs, lambda *_: {})
    for rank in range(3):
        assert torch.equal(out[rank]["y"], inputs[1]["x"])


@pytest.mark.parametrize("drop,want", [
    ("", set()),
    ("  - done:  {op: barrier}\n", {("race", "write-after-read", "y", "use", "send"),
                                    # the engine reads what send returns, at its return
                                    ("race", "write-after-read", "y", "send", "send")}),
])
def test_the_model_agrees_with_the_exact_brute_force(drop: str, want: set) -> None:
    """The checker gives every rank a store (SPMD effects); the brute force only the
    root's, as the kernel does: the same findings."""
    schedule = parse_text(SCHEDULE.replace(drop, "") if drop else SCHEDULE, "bc.yaml")
    for world in (2, 3, 4):
        assert oracle_keys(schedule, world) == want
        assert {f.key for f in hb.check(schedule, [world], hints=False).findings} == want


@pytest.mark.e2e
@pytest.mark.parametrize("world,backend", [(2, "host"), (3, "torch")])
def test_dcpc_run_matches_float64(tmp_path: Path, world: int, backend: str) -> None:
    report = run_schedule(RunConfig(schedule=str(write(tmp_path, SCHEDULE, "bc.yaml")), world=world,
                                    backend=backend, calls=4, seed=31 + world))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert report.outputs["y"].compared == 4 * world, text


@pytest.mark.parametrize(("text", "world", "root_of"), [
    # root 2 at W=3: the race on rank 0's y was shown with rank 1 (a phantom) storing
    (SCHEDULE.replace("root: 1}", "root: 2}"), 3, lambda owner: 2),
    # a team broadcast over node from node 0 (2x2, rank = 2 node + gpu): the root of
    # rank 0's team is rank 0, whose own store does not race its read; node 1 was named
    (SCHEDULE.replace("sizes:\n", "mesh: {node: N, gpu: G}\nsizes:\n  N: {max: 4}\n"
                      "  G: {max: 4}\n").replace("root: 1}", "axis: node}"),
     MeshWorld((2, 2)), lambda owner: owner % 2),
])
def test_a_race_s_counterexample_names_the_root_as_the_writer(text: str, world: int,
                                                              root_of) -> None:
    """The model gives every rank a store; the counterexample is translated (a rotation;
    on a mesh, of the torus) so the store it shows is the root's, as the kernel's."""
    schedule = parse_text(text.replace("  - done:  {op: barrier}\n", ""), "bc.yaml")
    findings = hb.check(schedule, [world], hints=False).findings
    assert {f.key for f in findings} == {("race", "write-after-read", "y", "use", "send"),
                                         ("race", "write-after-read", "y", "send", "send")}
    for f in findings:
        store = f.first if f.first.access == "write" else f.second
        assert store.step == "send" and store.rank == root_of(store.owner), f.message
