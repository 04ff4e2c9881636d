"""A split all_gather, all_to_all and reduce_scatter (``phase: put`` / ``phase: wait``,
dcpc/ops/all_gather.py, all_to_all.py and reduce_scatter.py, matched by
dcpc/ops/_split.py as ragged's are), each the same way: the verifier's unmatched halves,
a read of dst between the put and its wait, a second push into dst in flight (the same
call's, a whole op's, the next call's), the checker against the brute force of
tests/support/hb_oracle.py and the execution oracle, the float64 reference (dst lands at
the wait, as the whole op gives it: lists, interleave, stack and concat; a
reduce_scatter's sum, made at the wait), a team, the two kernels, and the torch and
local backends against float64 (the host backend runs schedules/ops/*_split.yaml in
tests/ops/test_op_schedules.py). all_to_all refuses a split cast. A reduce_scatter's
in-flight buffer is its via (x_all below)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.exec_oracle_agree import assert_three_agree
from support.schedules import diagnostics, error_marks, run_clean

from dcpc.harness.simulate import seen_at, simulate_call
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_text

OPS_DIR = Path(__file__).resolve().parents[2] / "schedules/ops"
OPS = ("all_gather", "all_to_all", "reduce_scatter")
SHAPES = {"all_gather": ("[T, D]", "[W*T, D]"), "all_to_all": ("[W*T, D]", "[W, T, D]"),
          "reduce_scatter": ("[W*T, D]", "[W, T, D]")}
DST = {"reduce_scatter": "x_sum, via: x_all"}  # the others: x_all

HEAD = """\
schedule: split_{op}
slots: {slots}
sizes: {{T: {{max: 4}}, D: 8}}
buffers: {{x: {{shape: {x}, dtype: bf16}}, x2: {{shape: {x}, dtype: bf16}},
          w: {{shape: [T, D], dtype: f32}}, y: {{shape: [T, D], dtype: f32}},
          x_sum: {{shape: [T, D], dtype: f32}},
          x_all: {{shape: {all}, dtype: bf16, symmetric: true}}}}
steps:
"""
PUT = "  - send: {op: OP, src: x, dst: DST, phase: put}\n"
WAIT = "  - recv: {op: OP, src: x, dst: DST, phase: wait}\n"
WORK = "  - work: {op: external, reads: [w], writes: [y]}\n"
USE = "  - use:  {op: external, reads: [x_all, w], writes: [y]}\n"
PEEK = "  - peek: {op: external, reads: [w, x_all], writes: [y]}\n"
FILL = "  - fill: {op: external, reads: [w], writes: [x_all]}\n"
DONE = "  - done: {op: barrier}\n"


def text(op: str, *steps: str, slots: int = 1) -> str:
    x, gathered = SHAPES[op]
    return (HEAD.format(op=op, slots=slots, x=x, all=gathered)
            + "".join(steps).replace("op: OP", f"op: {op}").replace("DST", DST.get(op, "x_all")))


def at(source: str, step: str) -> tuple[int, int]:
    """(line, col) of the value of ``step``'s ``phase:`` in ``source``."""
    for n, line in enumerate(source.splitlines(), 1):
        if line.startswith(f"  - {step}:"):
            return n, line.index("phase: ") + len("phase: ") + 1
    raise AssertionError(step)


def errors(source: str, tmp_path: Path, worlds: tuple = (2, 3)) -> list[tuple[str, int, int]]:
    return error_marks(source, tmp_path, "split.yaml", worlds)


@pytest.mark.parametrize("op", OPS)
def test_a_split_pair_is_proved(op: str, tmp_path: Path) -> None:
    assert errors(text(op, PUT, WORK, WAIT, USE, DONE), tmp_path) == []


SAID = {
    ("all_gather", "unmatched-wait"): "step 'recv' waits for the gather into 'x_all', but no "
    "'phase: put' step with the same src, dst, dim, interleave and axis is written before it",
    ("all_gather", "unmatched-put"): "step 'send' puts 'x' into every peer's 'x_all', but no "
    "'phase: wait' step",
    ("all_to_all", "unmatched-wait"): "step 'recv' waits for the parts into 'x_all', but no "
    "'phase: put' step with the same src, dst, dim, split_dim, concat_dim and axis is "
    "written before it",
    ("all_to_all", "unmatched-put"): "step 'send' puts the parts of 'x' to every peer, but no "
    "'phase: wait' step",
    ("reduce_scatter", "unmatched-wait"): "step 'recv' waits for the parts of 'x' to sum into "
    "'x_sum', but no 'phase: put' step with the same src, dst, dim, via, output_scale and "
    "axis is written before it",
    ("reduce_scatter", "unmatched-put"): "step 'send' puts the parts of 'x' to every peer, but "
    "no 'phase: wait' step",
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("steps", "code"), [
    ((WAIT, USE, DONE), "unmatched-wait"), ((PUT, WORK, DONE), "unmatched-put"),
], ids=["wait_without_put", "put_without_wait"])
def test_an_unmatched_half_is_located(op: str, steps: tuple[str, ...], code: str,
                                      tmp_path: Path) -> None:
    source = text(op, *steps)
    (lonely,) = [d for d in diagnostics(source, tmp_path, "split.yaml") if d.code == code]
    step = "recv" if code == "unmatched-wait" else "send"
    assert (lonely.mark.line, lonely.mark.col) == at(source, step), lonely
    assert SAID[op, code] in lonely.message and lonely.hint is not None


def unmatched(source: str, tmp_path: Path) -> list[tuple[str, int, int]]:
    """``errors`` of the unmatched halves (a reduce_scatter's wait written first also
    reads its via, which nothing wrote: read-before-write)."""
    return [e for e in errors(source, tmp_path) if e[0].startswith("unmatched-")]


@pytest.mark.parametrize("op", OPS)
def test_a_wait_before_its_put_or_of_another_src_matches_nothing(op: str,
                                                                 tmp_path: Path) -> None:
    """Every rank waits for every peer's put: written first, no rank would ever put; a
    wait naming another src is no wait of this put."""
    first = text(op, WAIT, PUT, USE, DONE)
    assert unmatched(first, tmp_path) == sorted([
        ("unmatched-put", *at(first, "send")), ("unmatched-wait", *at(first, "recv"))])
    twin = text(op, PUT, WORK, WAIT.replace("src: x,", "src: x2,"), USE, DONE)
    assert unmatched(twin, tmp_path) == sorted([
        ("unmatched-put", *at(twin, "send")), ("unmatched-wait", *at(twin, "recv"))])


@pytest.mark.parametrize("op", OPS)
def test_a_read_between_the_put_and_its_wait_is_unwritten(op: str, tmp_path: Path) -> None:
    source = text(op, PUT, PEEK, WAIT, DONE)
    (bad,) = [d for d in diagnostics(source, tmp_path, "split.yaml")
              if d.code == "read-before-write"]
    line = next(n for n, text in enumerate(source.splitlines(), 1) if "- peek:" in text)
    assert (bad.mark.line, bad.mark.col) == (line, 37), bad  # at peek's x_all
    assert "the data of 'send' is in flight until its wait 'recv'" in bad.message


SECOND = "  - again: {op: OP, src: x, dst: DST, phase: put}\n"
LAST = "  - last: {op: OP, src: x, dst: DST, phase: wait}\n"
WHOLE = "  - again: {op: OP, src: x, dst: DST}\n"


# the wait (a whole op: the step) returns dst, and the engine reads what it returned at its
# return (a reduce_scatter's wait reads its via, the sum, there too): that read races the
# other push as well, the same finding for every op
RETURN_READS = {
    "two_puts_in_flight": {("race", "write-after-read", "x_all", "recv", "again")},
    "a_whole_op_between": {("race", "write-after-read", "x_all", "again", "send")},
    "next_call_s_push": {("race", "write-after-read", "x_all", "recv", "send")},
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("case", "steps", "want"), [
    ("safe", (PUT, WORK, WAIT, USE, DONE), set()),
    ("read_and_write_between", (FILL, PUT, PEEK, WAIT, DONE),
     {("race", "write-after-read", "x_all", "peek", "send"),
      ("race", "write-after-write", "x_all", "fill", "send")}),
    ("two_puts_in_flight", (PUT, SECOND, WAIT, LAST, USE, DONE),
     {("race", "write-after-write", "x_all", "send", "again")}),
    ("a_whole_op_between", (PUT, WHOLE, WAIT, USE, DONE),
     {("race", "write-after-write", "x_all", "again", "send")}),
    ("next_call_s_push", (PUT, WORK, WAIT, USE),
     {("race", "write-after-read", "x_all", "use", "send"),
      ("race", "write-after-write", "x_all", "send", "send")}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_checker_agrees_with_brute_force_and_execution(op: str, case: str,
                                                      steps: tuple[str, ...],
                                                      want: set) -> None:
    """dst is in flight from the put to its wait: a step between that reads or writes it
    (a barrier does not help), a second push into it (a put, a whole op, the next call's
    put before the receiver's reads of this call), is a race naming the put."""
    want = want | RETURN_READS.get(case, set())
    assert_three_agree(parse_text(text(op, *steps)), want, f"{op} {case}", worlds=(2, 3))


LISTS = {"all_gather": """\
schedule: lists_all_gather
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
""", "all_to_all": """\
schedule: lists_all_to_all
sizes: {T: {max: 6}, H: 2, D: 4}
buffers:
  q:       {shape: [T, W*H, D],    dtype: f32}
  lse:     {shape: [T, W*H],       dtype: f32}
  k:       {shape: [T, W*H, D],    dtype: f32}
  q_full:  {shape: [W, T, H, D],   dtype: f32, symmetric: true}
  lse_all: {shape: [W, T, H],      dtype: f32, symmetric: true}
  k_all:   {shape: [W*T, H, D],    dtype: f32, symmetric: true}
  w:       {shape: [T, H],         dtype: f32}
  y:       {shape: [T, H],         dtype: f32}
steps:
  - send:    {op: all_to_all, src: [q, lse], dst: [q_full, lse_all], dim: 1, phase: put}
  - kv_put:  {op: all_to_all, src: k, dst: k_all, split_dim: 1, concat_dim: 0, phase: put}
  - work:    {op: external, reads: [w], writes: [y]}
  - recv:    {op: all_to_all, src: [q, lse], dst: [q_full, lse_all], dim: 1, phase: wait}
  - kv_wait: {op: all_to_all, src: k, dst: k_all, split_dim: 1, concat_dim: 0, phase: wait}
  - done:    {op: barrier}
""", "reduce_scatter": """\
schedule: lists_reduce_scatter
sizes: {T: {max: 6}, H: 2, D: 4}
buffers:
  q:       {shape: [T, W*H, D],    dtype: f32}
  q_sum:   {shape: [T, H, D],      dtype: f32}
  k:       {shape: [W*T, D],       dtype: f32}
  k_via:   {shape: [W, T, D],      dtype: f32, symmetric: true}
  k_sum:   {shape: [T, D],         dtype: f32}
  w:       {shape: [T, H],         dtype: f32}
  y:       {shape: [T, H],         dtype: f32}
steps:
  - send:    {op: reduce_scatter, src: q, dst: q_sum, dim: 1, phase: put}
  - kv_put:  {op: reduce_scatter, src: k, dst: k_sum, via: k_via, phase: put}
  - work:    {op: external, reads: [w], writes: [y]}
  - recv:    {op: reduce_scatter, src: q, dst: q_sum, dim: 1, phase: wait}
  - kv_wait: {op: reduce_scatter, src: k, dst: k_sum, via: k_via, phase: wait}
  - done:    {op: barrier}
"""}
INPUTS = {"all_gather": {"q": (6, 2, 4), "lse": (6, 2), "k": (18, 4)},
          "all_to_all": {"q": (6, 6, 4), "lse": (6, 6), "k": (6, 6, 4)},
          "reduce_scatter": {"q": (6, 6, 4), "k": (18, 4)}}  # at W = 3
MOVED = ("q_full", "lse_all", "k_all")
LANDED = {"all_gather": MOVED, "all_to_all": MOVED, "reduce_scatter": ("q_sum", "k_via", "k_sum")}


def _whole(source: str) -> str:
    """The same schedule with each put whole (its wait dropped)."""
    lines = [line for line in source.splitlines() if "phase: wait" not in line]
    return "\n".join(line.replace(", phase: put", "") for line in lines) + "\n"


@pytest.mark.parametrize("op", OPS)
def test_dst_lands_at_the_wait_as_the_whole_op_moves_it(op: str) -> None:
    """The float64 reference: nothing lands at the puts (a list of two payloads, and an
    interleaved gather or a split_dim/concat_dim exchange, in flight at once; a
    reduce_scatter through its implicit via and through an explicit one); at the waits
    every rank holds what the whole op gives."""
    split, whole = parse_text(LISTS[op]), parse_text(_whole(LISTS[op]))
    g = torch.Generator().manual_seed(7)
    inputs = [{name: torch.randn(*shape, generator=g, dtype=torch.float64).float().double()
               for name, shape in INPUTS[op].items()} | {"w": torch.zeros(6, 2).double()}
              for _ in range(3)]  # f32 values: stored exactly

    def work(step: object, rank: int, bufs: dict) -> dict:
        return {"y": bufs["w"] + 1}

    trace: list = []
    sizes = {"T": 6, "H": 2, "D": 4}
    got = simulate_call(split, 3, sizes, inputs, external=work, trace=trace)
    want = simulate_call(whole, 3, sizes, inputs, external=work)
    for j in range(3):
        for name in LANDED[op]:
            assert seen_at(trace, 3, j, name) is None, name  # in flight until its wait
            assert torch.equal(got[j][name], want[j][name]), name
        # rank 1's block: an all_gather's k (rows 0..2 of its first interleave block), an
        # all_to_all's part j of k (block 1 along concat_dim); a reduce_scatter's sum
        if op == "all_gather":
            assert torch.equal(got[j]["k_all"][3:6], inputs[1]["k"][:3])
        elif op == "all_to_all":
            assert torch.equal(got[j]["k_all"][6:12], inputs[1]["k"][:, 2 * j:2 * j + 2])
        else:
            total = sum(inputs[p]["k"][6 * j:6 * j + 6] for p in range(3))
            assert torch.equal(got[j]["k_sum"], total.float().double())


AXIS = """\
schedule: team_{op}
slots: 1
mesh: {{node: N, gpu: G}}
sizes: {{N: {{max: 4}}, G: {{max: 4}}, T: {{max: 4}}, D: 8}}
buffers:
  x:      {{shape: {x}, dtype: bf16}}
  x_node: {{shape: {team}, dtype: bf16, symmetric: true}}
  w:      {{shape: [T, D], dtype: f32}}
  y:      {{shape: [T, D], dtype: f32}}
steps:
  - send: {{op: {op}, axis: gpu, src: x, dst: x_node, phase: put}}
  - work: {{op: external, reads: [w], writes: [y]}}
  - recv: {{op: {op}, axis: gpu, src: x, dst: x_node, phase: wait}}
  - use:  {{op: external, reads: [x_node, w], writes: [y]}}
  - done: {{op: barrier}}
"""
TEAM = {"all_gather": ("[T, D]", "[G*T, D]"), "all_to_all": ("[G*T, D]", "[G, T, D]"),
        "reduce_scatter": ("[G*T, D]", "[T, D]")}


@pytest.mark.parametrize("op", OPS)
def test_a_team_s_split_exchange(op: str, tmp_path: Path) -> None:
    """Along one mesh axis the pair keys on the axis too: proved; a wait along the other
    axis is no wait of this put; on the host and torch backends at 2x2 it matches
    float64."""
    source = AXIS.format(op=op, x=TEAM[op][0], team=TEAM[op][1])
    meshes = (MeshWorld((2, 2)), MeshWorld((2, 3)))
    assert errors(source, tmp_path, meshes) == []
    twin = source.replace("axis: gpu, src: x, dst: x_node, phase: wait",
                          "axis: node, src: x, dst: x_node, phase: wait")
    assert {c for c, _, _ in errors(twin, tmp_path, meshes)} >= {"unmatched-put",
                                                                 "unmatched-wait"}
    path = tmp_path / "team.yaml"
    path.write_text(source)
    for backend in ("host", "torch"):
        report, said = run_clean(schedule=str(path), world=MeshWorld((2, 2)), backend=backend,
                                 calls=2, seed=3)
        assert "x_node" in report.outputs, said


@pytest.mark.parametrize("op", OPS)
def test_a_wait_s_keys_compare_as_meant_not_as_written(op: str, tmp_path: Path) -> None:
    """``axis: gpu`` is ``axis: [gpu]``, and a dim counted from the end is the dim it
    means: a wait written the other way still polls its put. A negative ``dim`` is
    refused (dim-out-of-range), alone: no unmatched halves besides."""
    team = AXIS.format(op=op, x=TEAM[op][0], team=TEAM[op][1]).replace(
        "axis: gpu, src: x, dst: x_node, phase: wait", "axis: [gpu], src: x, dst: x_node, "
        "phase: wait")
    assert errors(team, tmp_path, (MeshWorld((2, 2)),)) == []
    negative = text(op, PUT, WAIT).replace(", phase: put}", ", dim: -2, phase: put}")
    assert {c for c, _, _ in errors(negative, tmp_path)} == {"dim-out-of-range"}
    if op == "all_to_all":  # split_dim/concat_dim may count from the end
        concat = text(op, PUT, WAIT, DONE).replace("x_all: {shape: [W, T, D]",
                                                    "x_all: {shape: [W*T, D]")
        concat = concat.replace(", phase: put}", ", split_dim: 0, concat_dim: -2, phase: put}")
        concat = concat.replace(", phase: wait}", ", split_dim: -2, concat_dim: 0, phase: wait}")
        assert errors(concat, tmp_path) == []


def test_an_all_to_all_cast_is_not_split(tmp_path: Path) -> None:
    source = text("all_to_all", PUT, WAIT, USE, DONE).replace(
        "x_all: {shape: [W, T, D], dtype: bf16,", "x_all: {shape: [W, T, D], dtype: fp8e4m3,")
    source = source.replace(", phase: put}", ", scale: {per: tensor, buffer: s}, phase: put}")
    source = source.replace("x2: {shape:", "s: {shape: [1], dtype: f32}, x2: {shape:")
    found = [d for d in diagnostics(source, tmp_path, "split.yaml") if d.code == "bad-cast"]
    assert found and "a cast does not split" in found[0].message, found



def test_a_split_cast_s_forms_are_still_verified(tmp_path: Path) -> None:
    """The refused split cast does not hide the cast's other errors: a put that casts
    with split_dim/concat_dim is told both (each at its key)."""
    source = text("all_to_all", PUT, WAIT).replace(
        ", phase: put}", ", scale: {per: tensor, buffer: s}, split_dim: 0, concat_dim: 0,\n"
        "           phase: put}")
    source = source.replace("x2: {shape:", "s: {shape: [1], dtype: f32}, x2: {shape:")
    found = [(d.code, d.message) for d in diagnostics(source, tmp_path, "split.yaml")]
    assert [c for c, m in found if "a cast does not split" in m] == ["bad-cast"], found
    assert [c for c, m in found if "only with dim" in m] == ["bad-cast"], found


FILES = {op: OPS_DIR / f"{op}_split.yaml" for op in OPS}
PAIRS = {"all_gather": {"recv": "send", "kv_wait": "kv_put"},
         "all_to_all": {"recv": "send", "landed": "back"},
         "reduce_scatter": {"recv": "send", "rows_sum": "rows_put", "q_sum": "q_put"}}
PUSH = {"reduce_scatter": "tl.store(peer_via"}  # the others': any store (the wait's sum stores)


@pytest.mark.parametrize("op", OPS)
def test_the_put_only_pushes_and_the_wait_only_polls(op: str, tmp_path: Path) -> None:
    """The two kernels (the op's template; sync.j2's wait_kernel, or reduce_scatter's
    sum): the put's stores its parts and releases, never waits; the wait's pushes
    nothing and waits, launched with its put's tuning (its grid)."""
    from dcpc.harness.run import compile_to

    _, module, _, _ = compile_to(str(FILES[op]), tmp_path, 2)
    code = Path(module).read_text()

    def kernel(name: str) -> str:
        start = code.index(f"def _{name}_kernel(")
        return code[start:code.index("\n@", start)]

    for wait, put in PAIRS[op].items():
        assert "_dcpc_release(" in kernel(put) and "_dcpc_wait(" not in kernel(put)
        assert "_dcpc_wait(" in kernel(wait) and "_dcpc_release(" not in kernel(wait)
        push = PUSH.get(op, "tl.store(")
        assert push in kernel(put) and push not in kernel(wait)
        assert f'_tune = self._tune["{put}"]  # a wait launches on its put\'s grid' in code


def test_a_reduce_scatter_put_takes_no_output_scale(tmp_path: Path) -> None:
    """Only the wait reads output_scale (it sums, then scales): the put's method takes
    src alone and its kernel is built without SCALE; the wait takes the scale."""
    from support.kernels import load, the_class

    from dcpc.harness.run import compile_to

    _, module, _, _ = compile_to(str(FILES["reduce_scatter"]), tmp_path, 2)
    cls = the_class(load(module))
    assert cls.METHODS["q_put"] == ("q_part",) and cls.METHODS["q_sum"] == ("scale",)
    code = Path(module).read_text()
    put = code[code.index("def _checked_q_put("):code.index("def q_sum(")]
    assert "SCALE=False" in put and "scale" not in put.replace("q_put", ""), put


OUTPUTS = {"all_gather": {"q_full", "lse_all", "k_all"},
           "all_to_all": {"q_h", "o_recv", "lse_recv"},
           "reduce_scatter": {"y_shard", "z_shard", "q_shard"}}


@pytest.mark.e2e
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["torch", "local"])
def test_the_split_file_matches_float64_on(op: str, backend: str) -> None:
    report, said = run_clean(schedule=str(FILES[op]), world=3, backend=backend, calls=3,
                             seed=5)
    assert OUTPUTS[op] <= set(report.outputs), said


GRID_BLOCK = 256  # elements per tile: the harness's sizes then make several tiles


@pytest.mark.e2e
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("put", "wait"), [(3, 1), (1, 3)], ids=["put_3_wait_1", "put_1_wait_3"])
def test_the_wait_launches_on_the_put_s_grid_whatever_its_own_tuning(op: str, put: int,
                                                                     wait: int) -> None:
    """The put and its wait tuned to other programs: the wait launches its put's grid
    (program i polls program i), so every call finishes and matches float64. Not
    vacuous: at these sizes and tiles 3 programs give a grid of at least 2 (the
    tracer's count of the put's programs at call 0, the maxima), so the two tunings'
    grids differ."""
    from dcpc.harness import trace as tr

    default = '"programs": 128, "num_warps": 4, "block": 4096}'
    tuned = tuple((f'"{step}": {{{default}',
                   f'"{step}": {{{default}'.replace("128", str(n)).replace("4096", str(GRID_BLOCK)))
                  for step, n in (("send", put), ("recv", wait)))
    run_clean(schedule=str(FILES[op]), world=2, backend="local", calls=3, seed=11,
              programs=None, module_patch=tuned)
    run = tr.run_traced(str(FILES[op]), 2, programs=3, block=GRID_BLOCK, calls=1)
    assert run.trace.programs["send"] >= 2, run.trace.programs


@pytest.mark.e2e
@pytest.mark.parametrize("op", OPS)
def test_the_kernels_touch_what_the_plan_says(op: str) -> None:
    """The access tracer (dcpc/harness/trace.py): the put's stores lie in its part of
    every peer's dst before its signal, and each wait kernel launches on its put's grid
    (program i polls program i)."""
    from dcpc.harness import trace as tr

    run = tr.run_traced(str(FILES[op]), 3, programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems
    waits = {s.name: s.attrs["tune_of"] for s in run.plan.steps if s.attrs.get("signal") is False}
    assert waits == PAIRS[op], waits
    for wait, put in waits.items():
        assert run.trace.programs[wait] == run.trace.programs[put] >= 2, run.trace.programs



MID = "  - mid:  {op: all_gather, src: w, dst: g}\n"  # binds the sizes from its argument


def _sizes_source(op: str) -> tuple[str, str]:
    """op's put, a whole all_gather of w into g, then the wait; the size the put binds."""
    if op == "ragged_all_to_all":
        from test_ragged_split import PUT as RPUT
        from test_ragged_split import WAIT as RWAIT
        from test_ragged_split import text as rtext
        source = rtext(RPUT, MID, RWAIT).replace(
            "steps:\n", "  g:      {shape: [W*W, C, H], dtype: f32, symmetric: true}\nsteps:\n")
        return source, "C"
    source = text(op, PUT, MID, WAIT).replace(
        "x_all: {", "g: {shape: [W*T, D], dtype: f32, symmetric: true},\n          x_all: {")
    return source, "T"


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "unguarded"])
@pytest.mark.parametrize("op", [*OPS, "ragged_all_to_all"])
def test_a_wait_on_other_sizes_than_its_put_s_is_refused(op: str, guard: bool,
                                                         tmp_path: Path) -> None:
    """A wait launches its put's grid from its own sizes: other sizes give another grid
    (programs that poll what the put's never sent, or sum, unguarded, what has not
    landed), so a wait that binds other sizes than its put's is refused, naming the put,
    the size and both values; guarded or not, checked (sizes=) or replayed (the fast
    path: the step between binds the sizes back to those the wait's plan was made at)."""
    from support.kernels import compile_text, load, the_class

    from dcpc.runtime.errors import DcpcArgumentError

    source, size = _sizes_source(op)
    cls = the_class(load(compile_text(source, tmp_path, (1,))))
    assert cls.PUTS == {"recv": "send"}
    ragged = op == "ragged_all_to_all"

    def put(module, n: int) -> None:
        if ragged:
            module.send(torch.zeros(1, n, 8, dtype=torch.bfloat16),
                        torch.tensor([n], dtype=torch.int32))
        else:
            module.send(torch.zeros(n, 8, dtype=torch.bfloat16))

    def mid(module, n: int) -> None:
        module.mid(torch.zeros(*[1] * ragged, n, 8))

    module = cls(None, device="cpu", backend="host", guard=guard)
    put(module, 4)
    mid(module, 4)
    module.recv()  # the same sizes: its plan is kept
    put(module, 2)
    mid(module, 4)  # binds the size back: the wait's plan would replay
    with pytest.raises(DcpcArgumentError) as got:
        module.recv()
    assert (f"recv(): the wait of the split put 'send' runs on its sizes, but binds "
            f"{size}=4 where 'send' bound {size}=2 (slot 0)") in str(got.value)
    module.close()

    module = cls(None, device="cpu", backend="host", guard=guard)
    put(module, 4)
    mid(module, 4)
    with pytest.raises(DcpcArgumentError, match=f"binds {size}=3 where 'send' bound {size}=4"):
        module.recv(sizes={size: 3})
    module.close()
