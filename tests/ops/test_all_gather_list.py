"""all_gather with a list src/dst (several payloads, one kernel, one signal): every
stage, from the parser's errors to a run on both CPU backends against float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.schedules import errors, write

from dcpc import pipeline
from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.parse import parse_text

# q concatenated along dim 1, the LSEs stacked at dim 1: both payloads in one step
SCHEDULE = """\
schedule: ag_list
sizes:
  T: {max: 8}
  H: 4
  D: 16
buffers:
  q_local:   {shape: [T, H, D], dtype: bf16}
  lse_local: {shape: [T, H], dtype: f32}
  q_full:    {shape: [T, W*H, D], dtype: bf16, symmetric: true}
  lse_all:   {shape: [T, W, H], dtype: f32, symmetric: true}
steps:
  - gather:  {op: all_gather, src: [q_local, lse_local], dst: [q_full, lse_all], dim: 1}
  - use:     {op: external, reads: [q_full, lse_all]}
  - release: {op: barrier}
"""


def test_the_list_form_checks_clean_and_lowers_one_kernel(tmp_path: Path) -> None:
    c = pipeline.run(write(tmp_path, SCHEDULE, "ag_list.yaml"), pipeline.Options(worlds=(2, 3, 4)))
    (gather,) = [s for s in c.plan.steps if s.name == "gather"]
    assert gather.roles == {"src": "q_local", "dst": "q_full", "src1": "lse_local",
                            "dst1": "lse_all"}
    assert gather.returns == ["q_full", "lse_all"]
    assert c.module_text.count("def _gather_kernel(") == 1
    assert "dst_table1 = _dcpc_table(dst1_ptrs" in c.module_text


def test_unequal_lists_are_reported_at_dst(tmp_path: Path) -> None:
    text = SCHEDULE.replace("dst: [q_full, lse_all]", "dst: [q_full]")
    found = errors(write(tmp_path, text, "ag_list.yaml"))
    assert ("list-length-mismatch", 12, 63,
            "step 'gather' has 2 src buffers but 1 dst buffers") in found


def test_a_wrong_second_payload_is_reported_at_its_own_name(tmp_path: Path) -> None:
    text = SCHEDULE.replace("lse_all:   {shape: [T, W, H]", "lse_all:   {shape: [T, H, W]")
    found = errors(write(tmp_path, text, "ag_list.yaml"))
    assert [(c, line, col) for c, line, col, _ in found] == [("shape-mismatch", 12, 72)]
    assert "dst 'lse_all' of step 'gather' has shape [T, H, W] but must be [T, W, H]" in \
        found[0][3]


def test_an_empty_list_is_a_parse_error(tmp_path: Path) -> None:
    text = SCHEDULE.replace("src: [q_local, lse_local], dst: [q_full, lse_all]",
                            "src: [], dst: []")
    found = errors(write(tmp_path, text, "ag_list.yaml"))
    assert found == [
        ("wrong-type", 12, 36,
         "'steps.gather.src' must be a name or a list of names, not an empty list"),
        ("wrong-type", 12, 45,
         "'steps.gather.dst' must be a name or a list of names, not an empty list"),
    ]


def test_the_second_payload_races_without_the_barrier(tmp_path: Path) -> None:
    """The HB checker sees payload 1's remote writes: only lse_all is read after."""
    text = SCHEDULE.replace("reads: [q_full, lse_all]", "reads: [lse_all]")
    text = text.replace("  - release: {op: barrier}\n", "")
    found = errors(write(tmp_path, text, "ag_list.yaml"))
    assert [(c, line) for c, line, _, _ in found] == [("race", 12)] * 3
    (use,) = [m for *_, m in found if "use on rank" in m]
    assert "race on lse_all" in use and "index 1 of dim 1" in use
    # and the engine's read of both payloads gather returns, at its return
    returned = [m for *_, m in found if "use on rank" not in m]
    assert sorted(m.split(":")[0] for m in returned) == [
        "write-after-read race on lse_all", "write-after-read race on q_full"]
    assert all("while the engine still reads what gather on rank 0 (call 0) returned" in m
               for m in returned), returned


@pytest.mark.parametrize("world", [2, 3])
def test_the_reference_gathers_every_payload(world: int) -> None:
    schedule = parse_text(SCHEDULE, "ag_list.yaml")
    sizes = {"T": 3, "H": 4, "D": 16}
    gen = torch.Generator().manual_seed(world)
    inputs = [{"q_local": torch.randn(3, 4, 16, generator=gen, dtype=torch.float64),
               "lse_local": torch.randn(3, 4, generator=gen, dtype=torch.float64)}
              for _ in range(world)]
    inputs = [{k: simulate.as_stored(schedule, k, v) for k, v in rank.items()} for rank in inputs]
    out = simulate.simulate_call(schedule, world, sizes, inputs, lambda step, rank, bufs: {})
    q_want = torch.cat([inputs[p]["q_local"] for p in range(world)], dim=1)
    lse_want = torch.stack([inputs[p]["lse_local"] for p in range(world)], dim=1)
    for rank in range(world):
        assert torch.equal(out[rank]["q_full"], q_want)
        assert torch.equal(out[rank]["lse_all"], lse_want)


def _run(path: Path, world: int, backend: str, **kw: object) -> object:
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend=backend,
                                    calls=6, seed=5 + world, **kw))  # type: ignore[arg-type]
    return report


@pytest.mark.e2e
@pytest.mark.parametrize("world,backend", [(2, "host"), (3, "host"), (2, "torch")])
def test_dcpc_run_matches_float64(tmp_path: Path, world: int, backend: str) -> None:
    report = _run(write(tmp_path, SCHEDULE, "ag_list.yaml"), world, backend)
    text = format_report(report)  # type: ignore[arg-type]
    assert report.launch.ok and report.mismatches == 0, text  # type: ignore[attr-defined]
    for name in ("q_full", "lse_all"):
        assert report.outputs[name].compared == 6 * world, text  # type: ignore[attr-defined]


@pytest.mark.e2e
def test_dcpc_run_catches_a_second_payload_left_unsent(tmp_path: Path) -> None:
    """Mutation: the kernel pushes no tile of payload 1; the run must see it."""
    report = _run(write(tmp_path, SCHEDULE, "ag_list.yaml"), 2, "host",
                  module_patch=(("n_rows = outer1 * rows1", "n_rows = 0 * rows1"),))
    text = format_report(report)  # type: ignore[arg-type]
    assert report.outputs["lse_all"].mismatches > 0, text  # type: ignore[attr-defined]
    assert report.outputs["q_full"].mismatches == 0, text  # type: ignore[attr-defined]
