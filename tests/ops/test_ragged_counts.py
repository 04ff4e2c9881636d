"""Issue 22 (no silent wrong data): a negative ragged count (ragged_all_to_all's
``counts``) is refused as a count over capacity is: the kernel (ranks as threads: the
``local`` backend) fails the call on the sender and on the receiver, naming the step,
the rank and the count; the torch backend raises before it sends."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from support.schedules import ragged_head

from dcpc.runtime.errors import DcpcArgumentError, DcpcPeerFailedError

SCHEDULE = ragged_head("counts") + (
    "  - move: {op: ragged_all_to_all, src: x, dst: y, counts: n, recv_counts: m, capacity: C}\n")


def test_a_negative_count_fails_on_sender_and_receiver() -> None:
    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.local import LocalGroup

    with tempfile.TemporaryDirectory(prefix="dcpc-counts-") as tmp:
        path = Path(tmp) / "counts.yaml"
        path.write_text(SCHEDULE)
        _, module, _, _ = compile_to(str(path), Path(tmp), 2)

        def rank_main(rank: Any) -> str:
            inst = load_module_class(module, "counts")(rank, sizes={"C": 4}, device="cpu",
                                                       backend="local", timeout_s=20)
            x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(rank.rank))
            counts = torch.tensor([-1 if rank.rank == 1 else 2, 2], dtype=torch.int32)
            try:
                _, got = inst.move(x.bfloat16(), counts)
                return f"no error: recv_counts {got.tolist()}"
            except (DcpcArgumentError, DcpcPeerFailedError) as exc:
                return str(exc)
            finally:
                inst.close()

        ranks = LocalGroup(2, "cpu", timeout_s=60).run(rank_main)
    assert ranks[1].startswith("step 'move': rank 1's counts[0] = -1, a negative count; no "
                               "row of that part was sent"), ranks
    # the receiver names the bad count, or (rank 1 raised first: its flag is seen before
    # the counts) that peer 1 failed; it never returns data
    assert ranks[0].startswith("step 'move': peer 1 routed -1 rows to rank 0, a negative "
                               "count") or "peer 1 failed" in ranks[0], ranks


def test_a_negative_count_raises_on_the_torch_backend() -> None:
    from dcpc.runtime import collectives

    dst = torch.zeros(1, 4, 8)
    with pytest.raises(DcpcArgumentError, match=r"step 'move': rank 0's counts\[0\] = -1, "
                       "a negative count"):
        collectives.ragged_all_to_all(
            collectives.SlotGroup(None, 0, 0, None), torch.randn(1, 4, 8),
            torch.tensor([-1], dtype=torch.int32), dst, torch.zeros(1, dtype=torch.int32),
            4, 1, "move")


ROUTED = """\
schedule: routed
doc: an engine step (the router) writes the counts a ragged all_to_all reads
sizes: {C: {max: 4}, H: 16}
buffers:
  logits: {shape: [W, C, H], dtype: bf16}
  x_send: {shape: [W, C, H], dtype: bf16}
  counts: {shape: [W], dtype: i32}
  x_recv: {shape: [W, C, H], dtype: bf16, symmetric: true}
  n_recv: {shape: [W], dtype: i32, symmetric: true}
steps:
  - route:    {op: external, reads: [logits], writes: [x_send, counts]}
  - dispatch: {op: ragged_all_to_all, src: x_send, dst: x_recv, counts: counts,
               recv_counts: n_recv, capacity: C}
  - experts:  {op: external, reads: [x_recv, n_recv]}
  - done:     {op: barrier}  # without it the next call's dispatch races experts
"""


def test_counts_an_engine_step_writes_are_drawn_within_their_capacity(tmp_path: Path) -> None:
    """`dcpc run`'s synthetic engine step writes counts as an engine would, 0..capacity
    (it drew them as random floats: -2 ended the run in the simulator), and the run is
    clean."""
    from dcpc.harness import synth
    from dcpc.harness.run import RunConfig, run_schedule
    from dcpc.lang.parse import parse_text

    schedule = parse_text(ROUTED, "routed.yaml")
    route = schedule.step_list()[0]
    seen = []
    for call in range(12):
        sizes = synth.call_sizes(schedule, 3, {"C": 4}, 0, call)
        inputs = synth.call_inputs(schedule, 3, sizes, 0, call)
        for rank in range(3):
            counts = synth.make_external(schedule, 3, sizes, 0, call)(
                route, rank, {k: v.double() for k, v in inputs[rank].items()})["counts"]
            assert 0 <= int(counts.min()) and int(counts.max()) <= sizes["C"], counts
            seen += counts.tolist()
    assert len(set(seen)) > 2  # not one constant
    path = tmp_path / "routed.yaml"
    path.write_text(ROUTED)
    report = run_schedule(RunConfig(str(path), world=2, calls=4))
    assert report.ok, report.errors()


ONE_WEIGHTS = (  # every chunk's reduce takes one [T, N] of weights: only the index is sliced
    ("tok_w:      {shape: [P, T, N]", "tok_w:      {shape: [T, N]"),
    ('"tok_w[c]"', "tok_w"), ('"tok_w[P - VB + t]"', "tok_w"))


@pytest.mark.parametrize("edits", [(), ONE_WEIGHTS], ids=["shipped", "one_weights"])
def test_an_index_an_engine_step_writes_picks_live_rows_of_the_engine_s_counts(
        edits: tuple[tuple[str, str], ...]) -> None:
    """DeepEP normal mode's engine steps write the NVLink counts (n_fwd: nvl_counts, once
    per call from the rail meta) and, per chunk, the slots its reduce reads later
    (fwd_slot: the forwarding step, into the rows those counts return); it also reads
    only ragged receive buffers. The index was drawn against the previous call's counts
    and the float outputs derived from rows past a count (NaN in the reference, stale in
    a run): 3 to 7 mismatches at 2x2 in `dcpc run`. Now every slot is a live row and
    every value finite, also where the weights are one buffer for every chunk (the
    counts are the index's own slice's, not the weights')."""
    from dcpc.harness import synth
    from dcpc.harness.simulate import simulate_call
    from dcpc.lang.mesh import MeshWorld
    from dcpc.lang.parse import parse_text

    world = MeshWorld((2, 2))
    path = Path(__file__).resolve().parents[2] / "schedules" / "gallery" / "deepep_normal.yaml"
    text = path.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    schedule = parse_text(text, path.name, world)
    for call in range(3):
        sizes = synth.call_sizes(schedule, world, {"N": 2, "G": 2, "C": 4, "T": 4}, 0, call)
        inputs = synth.call_inputs(schedule, world, sizes, 0, call)
        out = simulate_call(schedule, world, sizes, inputs,
                            external=synth.make_external(schedule, world, sizes, 0, call))
        cap = sizes["N"] * sizes["C"]
        for rank in out:
            for k in range(3):  # each chunk's slots: live rows of that chunk's counts
                # (not of the ring slot's name: chunk 2 lands in y_fwd[0], z_back[0])
                for index, counts, size in (("fwd_slot", "n_fwd", cap),
                                            ("tok_slot", "n_send", sizes["C"])):
                    live = {g * size + c for g, n in enumerate(rank[f"{counts}_{k}"].tolist())
                            for c in range(n)}
                    slots = set(rank[f"{index}_{k}"].reshape(-1).tolist()) - {-1}
                    assert slots <= live, (call, k, index, sorted(slots - live))
                assert bool(rank[f"fwd_w_{k}"].isfinite().all())
                assert bool(rank[f"z_rail_{k}"].isfinite().all())
                assert bool(rank[f"out_{k}"].isfinite().all())
