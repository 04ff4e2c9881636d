"""`dcpc run` of owner-indexed slices (`o_parts[(r - h) % W]`) on the torch backend
(gloo): the host backend runs the gallery's Meta CP layouts in tests/cli/test_gallery.py
at W 2, 3, 4. Every output matches float64, each hop's guarded copy reads the block in
hand on exactly its one rank, and the merge's output is compared on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.gallery import CALLS
from support.schedules import mesh_owner

from dcpc.harness import synth
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.simulate import simulate_call
from dcpc.lang.mesh import parse_shapes
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = [ROOT / "schedules" / "gallery" / f"meta_cp_pass_{k}.yaml" for k in ("kv", "q")]


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("path", LAYOUTS, ids=lambda p: p.stem)
def test_meta_cp_layouts_run_on_torch_against_float64(path: Path, world: int) -> None:
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend="torch",
                                    calls=CALLS, seed=16))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert report.outputs["out"].compared == CALLS * world, text
    # hop h reads the block in recv[h % 2], one copy per rank, each on its rank only
    for h in range(world - 2):
        for p in range(world):
            assert report.outputs[f"recv_{h % 2}@attend_h{h}_r{p}"].compared == CALLS, text
    for p in range(world):
        assert report.outputs[f"recv_{(world - 2) % 2}@attend_last_r{p}"].compared == CALLS


def _nonfinite_rows(text: str) -> int:
    """Non-finite values in the merged output's live rows (below query_start_loc[-1]),
    on every rank of the float64 reference, over four calls at W = 2, 3, 4."""
    bad = 0
    for world in (2, 3, 4):
        schedule = parse_text(text, "meta_cp_pass_kv.yaml", world)
        ctor = synth.constructor_sizes(schedule, world, None)
        for call in range(4):
            sizes = synth.call_sizes(schedule, world, ctor, 0, call)
            inputs = synth.call_inputs(schedule, world, sizes, 0, call)
            external = synth.make_external(schedule, world, sizes, 0, call)
            final = simulate_call(schedule, world, sizes, inputs, external)
            for bufs in final:
                rows = int(bufs["query_start_loc"][-1])
                bad += int((~torch.isfinite(bufs["out"][:rows])).sum())
    return bad


def test_a_hop_s_shard_puts_an_empty_block_s_garbage_where_the_merge_masks_it() -> None:
    """pass-KV's attends name the block's owner (`shard:`): the synthetic kernel's NaN/inf
    rows of an empty block land in that owner's slot, which mask_empty (local_lens[:, j])
    weighs 0, so the merged output is finite; without `shard:` the garbage follows the
    attending rank's shard instead and leaks into the output."""
    text = LAYOUTS[0].read_text()
    assert _nonfinite_rows(text) == 0
    assert _nonfinite_rows("\n".join(line for line in text.split("\n")
                                     if "shard:" not in line)) > 0


@pytest.mark.e2e
@pytest.mark.parametrize("shape", ["2x2", "1x3"])
def test_an_index_of_a_mesh_coordinate_runs_against_float64(shape: str, tmp_path: Path
                                                             ) -> None:
    """Each GPU's engine steps write its own slot and the others', a copy (a method) reads
    its own slot (the engine passes the view), the sum reads every slot, as the float64
    reference (which unrolls the same copies) has them."""
    path = tmp_path / "mesh_owner.yaml"
    path.write_text(mesh_owner())
    world = parse_shapes(shape, 64)[0]
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend="host",
                                    calls=3, seed=5))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert report.outputs["total"].compared == 3 * int(world), text
