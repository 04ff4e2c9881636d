"""all_to_all with split_dim/concat_dim (JAX's split_axis/concat_axis): the verifier,
the float64 meaning (Ulysses' round trip lands in token order), the checker against the
brute force, the kernels and the torch backend against float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.hb_oracle import oracle_keys
from support.schedules import errors, write

from dcpc.check import hb
from dcpc.codegen.lower import lower
from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.parse import parse_text

# sequence-sharded [S, H, D] -> head-sharded [W*S, H/W, D] -> back to [S, H, D]
SCHEDULE = """\
schedule: uly
sizes:
  S: {max: 8}
  H: {multiple_of: W}
  D: 4
buffers:
  q:    {shape: [S, H, D], dtype: f32}
  q_h:  {shape: [W*S, H/W, D], dtype: f32, symmetric: true}
  o_h:  {shape: [W*S, H/W, D], dtype: f32}
  o:    {shape: [S, H, D], dtype: f32, symmetric: true}
steps:
  - make:     {op: external, writes: [q]}
  - to_heads: {op: all_to_all, src: q, dst: q_h, split_dim: 1, concat_dim: 0}
  - attn:     {op: external, reads: [q_h], writes: [o_h]}
  - to_seq:   {op: all_to_all, src: o_h, dst: o, split_dim: 0, concat_dim: 1}
  - use:      {op: external, reads: [o]}
"""


@pytest.mark.parametrize("old,new,code,line,words", [
    ("split_dim: 1, concat_dim: 0}", "split_dim: 1}", "bad-dims", 13,
     "needs both split_dim and concat_dim"),
    ("split_dim: 1, concat_dim: 0}", "dim: 1, split_dim: 1, concat_dim: 0}", "bad-dims", 13,
     "has dim, split_dim, concat_dim"),
    ("concat_dim: 0}", "concat_dim: 3}", "dim-out-of-range", 13,
     "concat_dim 3 is out of range for src 'q', which has 3 dims"),
    ("q_h:  {shape: [W*S, H/W, D]", "q_h:  {shape: [S, H, D]", "shape-mismatch", 13,
     "dst 'q_h' of step 'to_heads' has shape [S, H, D] but must be [W*S, H/W, D]"),
    ("o:    {shape: [S, H, D], dtype: f32, symmetric: true}", "o:    {shape: [S, H, D], "
     "dtype: f32}", "not-symmetric", 15, "peers write into dst 'o'"),
])
def test_refusals(tmp_path: Path, old: str, new: str, code: str, line: int,
                  words: str) -> None:
    assert old in SCHEDULE
    found = errors(write(tmp_path, SCHEDULE.replace(old, new, 1), "uly.yaml"))
    assert [(c, ln) for c, ln, _, _ in found] == [(code, line)], found
    assert words in found[0][3], found


@pytest.mark.parametrize("world", [2, 3])
def test_the_round_trip_lands_in_token_order(world: int) -> None:
    schedule = parse_text(SCHEDULE, "uly.yaml")
    sizes, gen = {"S": 3, "H": 2 * world, "D": 4}, torch.Generator().manual_seed(world)
    inputs = [{"q": simulate.as_stored(schedule, "q", torch.randn(
        3, 2 * world, 4, generator=gen, dtype=torch.float64))} for _ in range(world)]

    def external(step, rank, bufs):  # noqa: ANN001, ANN202  (attention: the identity)
        return {"o_h": bufs["q_h"].clone()} if step.name == "attn" else {}

    out = simulate.simulate_call(schedule, world, sizes, inputs, external)
    hl = 2  # heads per rank
    for j in range(world):  # rank j: its heads, every rank's tokens in rank order
        want = torch.cat([inputs[p]["q"][:, j * hl:(j + 1) * hl] for p in range(world)])
        assert torch.equal(out[j]["q_h"], want)
        assert torch.equal(out[j]["o"], inputs[j]["q"])  # back where it started


def test_chained_exchanges_need_no_barrier_and_the_brute_force_agrees() -> None:
    """Each exchange's wait orders the other's buffer: no race at any W."""
    schedule = parse_text(SCHEDULE, "uly.yaml")
    for world in (2, 3):
        assert oracle_keys(schedule, world) == set()
        assert hb.check(schedule, [world]).findings == []


def test_a_lone_exchange_races_on_its_blocks() -> None:
    """Without to_seq, the next call's to_heads overwrites q_h (block p along dim 0) while
    attn may still read it; the message names the block."""
    text = SCHEDULE.replace(
        "  - to_seq:   {op: all_to_all, src: o_h, dst: o, split_dim: 0, concat_dim: 1}\n"
        "  - use:      {op: external, reads: [o]}\n", "")
    schedule = parse_text(text, "uly.yaml")
    want = {("race", "write-after-read", "q_h", "attn", "to_heads"),
            ("race", "write-after-read", "q_h", "to_heads", "to_heads")}  # the engine reads
    # what to_heads returns, at its return: the next call's push may land before it
    for world in (2, 3):
        assert oracle_keys(schedule, world) == want
        findings = hb.check(schedule, [world]).findings
        assert {f.key for f in findings} == want
    assert "W*S block 1 (dim 0)" in hb.check(schedule, [2]).findings[0].message


def test_stacking_exchanges_keep_their_plan() -> None:
    """The default (neither key) is today's exchange: no concat attribute, no block."""
    text = SCHEDULE.replace("q_h:  {shape: [W*S, H/W, D]", "q_h:  {shape: [W, S, H/W, D]")
    text = text.replace("split_dim: 1, concat_dim: 0}", "dim: 1}")
    plan = lower(parse_text(text, "uly.yaml"), (2, 3))
    (step,) = [s for s in plan.steps if s.name == "to_heads"]
    assert "concat" not in step.attrs and not any(n.startswith("block") for n, _ in step.scalars)


@pytest.mark.e2e
@pytest.mark.parametrize("world,backend", [(2, "torch")])  # host: the ulysses gallery
def test_dcpc_run_matches_float64(tmp_path: Path, world: int, backend: str) -> None:
    path = write(tmp_path, SCHEDULE, "uly.yaml")
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend=backend,
                                    calls=4, seed=3 + world))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    for name in ("q_h", "o"):
        assert report.outputs[name].compared == 4 * world, text
