"""A split all_gather (``phase: put`` / ``phase: wait``, dcpc/ops/all_gather.py, matched
by dcpc/ops/_split.py as ragged's are): the verifier's unmatched halves, a read of dst
between the put and its wait, a second push into dst in flight (the same call's, a
whole gather's, the next call's), the checker against the brute force of
tests/support/hb_oracle.py and the execution oracle, the float64 reference (dst lands
at the wait, as the whole op gives it: a list, interleave, a team), the two kernels,
and the torch and local backends against float64 (the host backend runs
schedules/ops/all_gather_split.yaml in tests/ops/test_op_schedules.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.exec_oracle_agree import assert_three_agree
from support.schedules import diagnostics, error_marks, run_clean

from dcpc.harness.simulate import seen_at, simulate_call
from dcpc.lang.parse import parse_text

FILE = Path(__file__).resolve().parents[2] / "schedules/ops/all_gather_split.yaml"

HEAD = """\
schedule: ags
slots: {slots}
sizes: {{T: {{max: 4}}, D: 8}}
buffers: {{x: {{shape: [T, D], dtype: bf16}}, w: {{shape: [T, D], dtype: f32}},
          y: {{shape: [T, D], dtype: f32}},
          x_all: {{shape: [W*T, D], dtype: bf16, symmetric: true}}}}
steps:
"""
PUT = "  - send: {op: all_gather, src: x, dst: x_all, phase: put}\n"
WAIT = "  - recv: {op: all_gather, src: x, dst: x_all, phase: wait}\n"
WORK = "  - work: {op: external, reads: [w], writes: [y]}\n"
USE = "  - use:  {op: external, reads: [x_all, w], writes: [y]}\n"
PEEK = "  - peek: {op: external, reads: [w, x_all], writes: [y]}\n"
FILL = "  - fill: {op: external, reads: [w], writes: [x_all]}\n"
DONE = "  - done: {op: barrier}\n"


def text(*steps: str, slots: int = 1) -> str:
    return HEAD.format(slots=slots) + "".join(steps)


def errors(source: str, tmp_path: Path, worlds: tuple = (2, 3)) -> list[tuple[str, int, int]]:
    return error_marks(source, tmp_path, "ags.yaml", worlds)


def test_a_split_pair_is_proved(tmp_path: Path) -> None:
    assert errors(text(PUT, WORK, WAIT, USE, DONE), tmp_path) == []


@pytest.mark.parametrize(("steps", "code", "said"), [
    ((WAIT, USE, DONE), "unmatched-wait",
     "step 'recv' waits for the gather into 'x_all', but no 'phase: put' step with the "
     "same src, dst, dim, interleave and axis is written before it"),
    ((PUT, WORK, DONE), "unmatched-put",
     "step 'send' puts 'x' into every peer's 'x_all', but no 'phase: wait' step"),
], ids=["wait_without_put", "put_without_wait"])
def test_an_unmatched_half_is_located(steps: tuple[str, ...], code: str, said: str,
                                      tmp_path: Path) -> None:
    (lonely,) = [d for d in diagnostics(text(*steps), tmp_path, "ags.yaml") if d.code == code]
    assert (lonely.mark.line, lonely.mark.col) == (8, 55), lonely  # at its `put`/`wait`
    assert said in lonely.message and lonely.hint is not None


def test_a_wait_before_its_put_and_a_wait_of_other_keys_match_nothing(tmp_path: Path) -> None:
    """Every rank waits for every peer's put: written first, no rank would ever put; a
    wait of another interleave is no wait of this put."""
    assert errors(text(WAIT, PUT, USE, DONE), tmp_path) == [
        ("unmatched-put", 9, 55), ("unmatched-wait", 8, 55)]
    twin = WAIT.replace("dst: x_all,", "dst: x_all, interleave: 1,")
    assert errors(text(PUT, WORK, twin, USE, DONE), tmp_path) == [
        ("unmatched-put", 8, 55), ("unmatched-wait", 10, 70)]


def test_a_read_between_the_put_and_its_wait_is_unwritten(tmp_path: Path) -> None:
    found = diagnostics(text(PUT, PEEK, WAIT, DONE), tmp_path, "ags.yaml", (2, 3))
    bad = [d for d in found if d.code == "read-before-write"]
    assert len(bad) == 1 and (bad[0].mark.line, bad[0].mark.col) == (9, 37), found
    assert "the data of 'send' is in flight until its wait 'recv'" in bad[0].message


SECOND = "  - again: {op: all_gather, src: x, dst: x_all, phase: put}\n"
LAST = "  - last: {op: all_gather, src: x, dst: x_all, phase: wait}\n"
WHOLE = "  - again: {op: all_gather, src: x, dst: x_all}\n"


@pytest.mark.parametrize(("case", "steps", "want"), [
    ("safe", (PUT, WORK, WAIT, USE, DONE), set()),
    ("read_and_write_between", (FILL, PUT, PEEK, WAIT, DONE),
     {("race", "write-after-read", "x_all", "peek", "send"),
      ("race", "write-after-write", "x_all", "fill", "send")}),
    ("two_puts_in_flight", (PUT, SECOND, WAIT, LAST, USE, DONE),
     {("race", "write-after-write", "x_all", "send", "again")}),
    ("a_whole_gather_between", (PUT, WHOLE, WAIT, USE, DONE),
     {("race", "write-after-write", "x_all", "again", "send")}),
    ("next_call_s_push", (PUT, WORK, WAIT, USE),
     {("race", "write-after-read", "x_all", "use", "send"),
      ("race", "write-after-write", "x_all", "send", "send")}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_checker_agrees_with_brute_force_and_execution(case: str, steps: tuple[str, ...],
                                                      want: set) -> None:
    """dst is in flight from the put to its wait: a step between that reads or writes it
    (a barrier does not help), a second push into it (a put, a whole gather, the next
    call's put before the receiver's reads of this call), is a race naming the put."""
    assert_three_agree(parse_text(text(*steps)), want, case, worlds=(2, 3))


LIST = """\
schedule: agl
slots: 1
sizes: {T: {max: 6}, H: 2, D: 4}
buffers:
  q:       {shape: [T, H, D],   dtype: f32}
  lse:     {shape: [T, H],      dtype: f32}
  k:       {shape: [3*T, D],    dtype: f32}
  q_full:  {shape: [T, W*H, D], dtype: f32, symmetric: true}
  lse_all: {shape: [T, W, H],   dtype: f32, symmetric: true}
  k_all:   {shape: [W*3*T, D],  dtype: f32, symmetric: true}
  w:       {shape: [T, H],      dtype: f32}
  y:       {shape: [T, H],      dtype: f32}
steps:
  - send:    {op: all_gather, src: [q, lse], dst: [q_full, lse_all], dim: 1, phase: put}
  - kv_put:  {op: all_gather, src: k, dst: k_all, interleave: 3, phase: put}
  - work:    {op: external, reads: [w], writes: [y]}
  - recv:    {op: all_gather, src: [q, lse], dst: [q_full, lse_all], dim: 1, phase: wait}
  - kv_wait: {op: all_gather, src: k, dst: k_all, interleave: 3, phase: wait}
  - done:    {op: barrier}
"""


def _whole(source: str) -> str:
    """The same schedule with each put whole (its wait dropped)."""
    lines = [line for line in source.splitlines() if "phase: wait" not in line]
    return "\n".join(line.replace(", phase: put", "") for line in lines) + "\n"


def test_dst_lands_at_the_wait_as_the_whole_op_gathers_it() -> None:
    """The float64 reference: nothing lands at the put (a list of a concat and a stack,
    and an interleaved gather in flight at once); at the wait every rank holds what the
    whole op gives."""
    split, whole = parse_text(LIST), parse_text(_whole(LIST))
    g = torch.Generator().manual_seed(7)
    sizes = {"T": 6, "H": 2, "D": 4}
    inputs = [{"q": torch.randn(6, 2, 4, generator=g, dtype=torch.float64),
               "lse": torch.randn(6, 2, generator=g, dtype=torch.float64),
               "k": torch.randn(18, 4, generator=g, dtype=torch.float64),
               "w": torch.zeros(6, 2, dtype=torch.float64)} for _ in range(3)]

    def work(step: object, rank: int, bufs: dict) -> dict:
        return {"y": bufs["w"] + 1}

    trace: list = []
    got = simulate_call(split, 3, sizes, inputs, external=work, trace=trace)
    want = simulate_call(whole, 3, sizes, inputs, external=work)
    for j in range(3):
        for name in ("q_full", "lse_all", "k_all"):
            assert seen_at(trace, 3, j, name) is None, name  # in flight until its wait
            assert torch.equal(got[j][name], want[j][name]), name
        assert torch.equal(got[j]["k_all"][3:6], inputs[1]["k"][:3].float().double())  # rank 1


AXIS = """\
schedule: aga
slots: 1
mesh: {node: N, gpu: G}
sizes: {N: {max: 4}, G: {max: 4}, T: {max: 4}, D: 8}
buffers:
  x:      {shape: [T, D],   dtype: bf16}
  x_node: {shape: [G*T, D], dtype: bf16, symmetric: true}
  w:      {shape: [T, D],   dtype: f32}
  y:      {shape: [T, D],   dtype: f32}
steps:
  - send: {op: all_gather, axis: gpu, src: x, dst: x_node, phase: put}
  - work: {op: external, reads: [w], writes: [y]}
  - recv: {op: all_gather, axis: gpu, src: x, dst: x_node, phase: wait}
  - use:  {op: external, reads: [x_node, w], writes: [y]}
  - done: {op: barrier}
"""


def test_a_team_s_split_gather(tmp_path: Path) -> None:
    """Along one mesh axis the pair keys on the axis too: proved; a wait along the other
    axis is no wait of this put; on the host backend at 2x2 it matches float64."""
    from dcpc.lang.mesh import MeshWorld

    meshes = (MeshWorld((2, 2)), MeshWorld((2, 3)))
    assert errors(AXIS, tmp_path, meshes) == []
    twin = AXIS.replace("axis: gpu, src: x, dst: x_node, phase: wait",
                        "axis: node, src: x, dst: x_node, phase: wait")
    assert {c for c, _, _ in errors(twin, tmp_path, meshes)} >= {"unmatched-put",
                                                                 "unmatched-wait"}
    path = tmp_path / "aga.yaml"
    path.write_text(AXIS)

    report, said = run_clean(schedule=str(path), world=MeshWorld((2, 2)), backend="host",
                             calls=2, seed=3)
    assert "x_node" in report.outputs, said


def test_the_put_only_pushes_and_the_wait_only_polls(tmp_path: Path) -> None:
    """The two kernels (templates/ops/all_gather.py.j2, sync.j2's wait_kernel): the
    put's stores the rows and releases, never waits; the wait's stores nothing and
    waits, launched with its put's tuning (its grid)."""
    from dcpc.harness.run import compile_to

    _, module, _, _ = compile_to(str(FILE), tmp_path, 2)
    code = Path(module).read_text()

    def kernel(name: str) -> str:
        start = code.index(f"def _{name}_kernel(")
        return code[start:code.index("\n@", start)]

    for put, wait in (("send", "recv"), ("kv_put", "kv_wait")):
        assert "_dcpc_release(" in kernel(put) and "_dcpc_wait(" not in kernel(put)
        assert "_dcpc_wait(" in kernel(wait) and "_dcpc_release(" not in kernel(wait)
        assert "tl.store(" not in kernel(wait)
        assert f'_tune = self._tune["{put}"]  # a wait launches on its put\'s grid' in code


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "local"])
def test_the_split_file_matches_float64_on(backend: str) -> None:
    report, said = run_clean(schedule=str(FILE), world=3, backend=backend, calls=3, seed=5)
    assert {"q_full", "lse_all", "k_all"} <= set(report.outputs), said


@pytest.mark.e2e
@pytest.mark.parametrize(("put", "wait"), [(3, 1), (1, 3)], ids=["put_3_wait_1", "put_1_wait_3"])
def test_the_wait_launches_on_the_put_s_grid_whatever_its_own_tuning(put: int,
                                                                     wait: int) -> None:
    """The put and its wait tuned to other programs: the wait launches its put's grid
    (program i polls program i), so every call finishes and matches float64."""
    tuned = tuple((f'"{step}": {{"programs": 128,', f'"{step}": {{"programs": {n},')
                  for step, n in (("send", put), ("recv", wait)))
    run_clean(schedule=str(FILE), world=2, backend="local", calls=3, seed=11, programs=None,
              module_patch=tuned)


@pytest.mark.e2e
def test_the_kernels_touch_what_the_plan_says() -> None:
    """The access tracer (dcpc/harness/trace.py): the put's stores lie in its part of
    every peer's dst before its signal, and each wait kernel launches on its put's grid
    (program i polls program i)."""
    from dcpc.harness import trace as tr

    run = tr.run_traced(str(FILE), 3, programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems
    waits = {s.name: s.attrs["tune_of"] for s in run.plan.steps if s.attrs.get("signal") is False}
    assert waits == {"recv": "send", "kv_wait": "kv_put"}, waits
    for wait, put in waits.items():
        assert run.trace.programs[wait] == run.trace.programs[put] >= 2, run.trace.programs
