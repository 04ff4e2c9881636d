"""The access tracer (dcpc/harness/trace.py) over the new collectives: every load and
store of all_reduce (sum, lse with its merge launch), all_to_all split/concat, broadcast
and reduce lies in an effect of its step's plan, in its phase and region, and every
effect is performed (W = 3, two programs per kernel, short tiles)."""

from __future__ import annotations

from pathlib import Path

from dcpc.harness import trace as tr

SCHEDULE = """\
schedule: new_ops
sizes:
  T: {max: 4}
  H: {multiple_of: W}
  D: 8
buffers:
  x:        {shape: [T, H, D], dtype: f32}
  o:        {shape: [T, H, D], dtype: f32}
  lse:      {shape: [T, H], dtype: f32, lse_base: e}
  y:        {shape: [T, H, D], dtype: f32}
  c:        {shape: [W*T, H/W, D], dtype: f32, symmetric: true}
  z:        {shape: [T, H, D], dtype: f32, symmetric: true}
  r:        {shape: [T, H, D], dtype: f32}
  o_recv:   {shape: [W, T, H, D], dtype: f32, symmetric: true}
  lse_recv: {shape: [W, T, H], dtype: f32, symmetric: true, lse_base: e}
  out:      {shape: [T, H, D], dtype: f32}
steps:
  - make:  {op: external, writes: [x, o, lse]}
  - ar:    {op: all_reduce, src: x, dst: y}
  - a2a:   {op: all_to_all, src: x, dst: c, split_dim: 1, concat_dim: 0}
  - bc:    {op: broadcast, src: x, dst: z, root: 2}
  - rd:    {op: reduce, src: x, dst: r, root: 1, reduce: max}
  - merge: {op: all_reduce, reduce: lse, src: [o, lse], via: [o_recv, lse_recv], dst: out}
  - use:   {op: external, reads: [y, c, z, r, out]}
  - done:  {op: barrier}
"""


def test_kernels_touch_what_the_plan_says(tmp_path: Path) -> None:
    path = tmp_path / "new_ops.yaml"
    path.write_text(SCHEDULE)
    run = tr.run_traced(str(path), 3, programs=2, block=8, calls=2)
    assert run.mismatches == 0
    assert run.problems == []
    for step in ("ar", "a2a", "bc", "rd", "merge"):
        assert run.trace.programs.get(step, 0) >= 1, run.trace.programs
