"""A split ragged_all_to_all (``phase: put`` / ``phase: wait``, dcpc/ops/ragged_all_to_all.py,
matched by dcpc/ops/_split.py as shift's are): the verifier's unmatched halves, the
race of a read between the put and its wait (the checker, the brute force of
tests/support/hb_oracle.py and the execution oracle agree), the float64 reference
(the rows land at the wait), the two kernels and what they touch (the access tracer), a
count over capacity on the kernels, and the torch and local backends against float64
(the host backend runs schedules/ops/ragged_all_to_all_split.yaml in
tests/ops/test_op_schedules.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import child_result
from support.exec_oracle_agree import assert_three_agree
from support.schedules import diagnostics

from dcpc.harness.simulate import seen_at, simulate_call
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "schedules" / "ops" / "ragged_all_to_all_split.yaml"

HEAD = """\
schedule: rags
slots: {slots}
sizes: {{C: {{max: 4}}, H: 8}}
buffers:
  x_send: {{shape: [W, C, H], dtype: bf16}}
  counts: {{shape: [W], dtype: i32}}
  other:  {{shape: [W], dtype: i32}}
  x_recv: {{shape: [W, C, H], dtype: bf16, symmetric: true}}
  n_recv: {{shape: [W], dtype: i32, symmetric: true}}
  w:      {{shape: [W, C, H], dtype: f32}}
  y:      {{shape: [W, C, H], dtype: f32}}
steps:
"""
PUT = """\
  - send: {op: ragged_all_to_all, src: x_send, dst: x_recv, counts: counts,
           recv_counts: n_recv, capacity: C, phase: put}
"""
WAIT = """\
  - recv: {op: ragged_all_to_all, src: x_send, dst: x_recv, counts: counts,
           recv_counts: n_recv, capacity: C, phase: wait}
"""
WORK = "  - work: {op: external, reads: [w], writes: [y]}\n"
USE = "  - use:  {op: external, reads: [x_recv, n_recv], writes: [y]}\n"
DONE = "  - done: {op: barrier}\n"


def text(*steps: str, slots: int = 1) -> str:
    return HEAD.format(slots=slots) + "".join(steps)


def errors(source: str, tmp_path: Path) -> list[tuple[str, int, int]]:
    return sorted((d.code, d.mark.line, d.mark.col)
                  for d in diagnostics(source, tmp_path, "rags.yaml", (2, 3))
                  if d.severity == "error")


def test_a_split_pair_is_proved(tmp_path: Path) -> None:
    assert errors(text(PUT, WORK, WAIT, USE, DONE), tmp_path) == []


@pytest.mark.parametrize(("steps", "code", "said"), [
    ((WAIT, USE, DONE), "unmatched-wait", "no 'phase: put' step with the same src, dst, counts"),
    ((PUT, WORK, DONE), "unmatched-put", "the receiver never learns that its data arrived"),
], ids=["wait_without_put", "put_without_wait"])
def test_an_unmatched_half_is_located(steps: tuple[str, ...], code: str, said: str,
                                      tmp_path: Path) -> None:
    found = diagnostics(text(*steps), tmp_path, "rags.yaml", (2, 3))
    lonely = [d for d in found if d.code == code]
    assert len(lonely) == 1, found
    # at the value of the step's `phase:` (its second line), with a hint
    assert (lonely[0].mark.line, lonely[0].mark.col) == (14, 53), lonely[0]
    assert said in lonely[0].message and lonely[0].hint is not None


def test_a_wait_before_its_put_is_a_lonely_wait(tmp_path: Path) -> None:
    """Every rank waits for every peer's put: written first, no rank would ever put
    (a shift's chain may wait first; an all-to-all is a ring of every rank)."""
    got = {c for c, _, _ in errors(text(WAIT, PUT, USE, DONE), tmp_path)}
    assert {"unmatched-wait", "unmatched-put"} <= got, got


def test_the_wrong_twin_matches_nothing(tmp_path: Path) -> None:
    """A wait naming other counts is no wait of this put: both halves are unmatched."""
    twin = WAIT.replace("counts: counts,", "counts: other,")
    assert errors(text(PUT, WORK, twin, USE, DONE), tmp_path) == [
        ("unmatched-put", 14, 53), ("unmatched-wait", 17, 53)]


PEEK = "  - peek: {op: external, reads: [w, x_recv], writes: [y]}\n"
FILL = "  - fill: {op: external, reads: [w], writes: [x_recv]}\n"
RACE = {("race", "write-after-read", "x_recv", "peek", "send"),
        ("race", "write-after-write", "x_recv", "fill", "send")}


def test_a_read_between_the_put_and_its_wait_is_unwritten(tmp_path: Path) -> None:
    """Nothing wrote x_recv earlier in the call: the read between is a read of data in
    flight, located at the read and naming the put and its wait."""
    found = diagnostics(text(PUT, PEEK, WAIT, DONE), tmp_path, "rags.yaml", (2, 3))
    bad = [d for d in found if d.code == "read-before-write"]
    assert len(bad) == 1 and bad[0].mark.line == 15, found
    assert "the data of 'send' is in flight until its wait 'recv'" in bad[0].message


@pytest.mark.parametrize("case", ["safe", "race"])
def test_checker_agrees_with_brute_force_and_execution(case: str) -> None:
    """x_recv written by this rank, then the put: a peer's store in flight until the
    wait races the read (and the local write) on this rank, whatever orders them."""
    source = (text(PUT, WORK, WAIT, USE, DONE, slots=2) if case == "safe"
              else text(FILL, PUT, PEEK, WAIT, DONE))
    assert_three_agree(parse_text(source), set() if case == "safe" else RACE, case,
                       worlds=(2, 3))


SPELLED = """\
schedule: spelled
sizes: {C: {max: 2}, H: 8}
buffers:
  x_send: {shape: [W, 2*C, H], dtype: bf16}
  counts: {shape: [W], dtype: i32}
  x_recv: {shape: [W, 2*C, H], dtype: bf16, symmetric: true}
  n_recv: {shape: [W], dtype: i32, symmetric: true}
  w:      {shape: [W, 2*C, H], dtype: f32}
  y:      {shape: [W, 2*C, H], dtype: f32}
steps:
  - send: {op: ragged_all_to_all, src: x_send, dst: x_recv, counts: counts,
           recv_counts: n_recv, capacity: 2*C, phase: put}
  - work: {op: external, reads: [w], writes: [y]}
  - recv: {op: ragged_all_to_all, src: [x_send], dst: [x_recv], counts: counts,
           recv_counts: n_recv, capacity: (2 * C), phase: wait}
  - use:  {op: external, reads: [x_recv, n_recv], writes: [y]}
  - done: {op: barrier}
"""


def test_a_pair_matches_whatever_the_spelling(tmp_path: Path) -> None:
    """The wait names its payloads as a list and its capacity as `(2 * C)`, the put as one
    name and `2*C`: the same names and the same expression, so one pair for the checker
    (dcpc.ops._split) and for the brute force of tests/support/hb_oracle.py (each by its
    own matching), and the execution oracle agrees: no race."""
    assert errors(SPELLED, tmp_path) == []
    assert_three_agree(parse_text(SPELLED), set(), "spelled", worlds=(2, 3))


def test_the_brute_force_names_an_unmatched_put() -> None:
    """The brute force is asked only about matched schedules; an unmatched put is a
    clear assertion naming it, not a StopIteration."""
    from support.hb_oracle import build

    with pytest.raises(AssertionError, match="brute force: put 'send' has no later "
                       "'phase: wait' ragged_all_to_all"):
        build(parse_text(text(PUT, WORK, DONE)), 2)


CAST = """\
schedule: ragq
slots: 1
sizes: {C: {max: 4}, H: 8}
buffers:
  x_send: {shape: [W, C, H], dtype: bf16}
  counts: {shape: [W], dtype: i32}
  q_recv: {shape: [W, C, H], dtype: fp8e4m3, symmetric: true}
  s_recv: {shape: [W, C], dtype: f32, symmetric: true}
  n_recv: {shape: [W], dtype: i32, symmetric: true}
  y:      {shape: [W, C], dtype: f32}
steps:
  - send: {op: ragged_all_to_all, src: x_send, dst: q_recv, counts: counts, phase: put,
           recv_counts: n_recv, capacity: C, scale: {per: token, buffer: s_recv}}
{between}  - recv: {op: ragged_all_to_all, src: x_send, dst: q_recv, counts: counts, phase: wait,
           recv_counts: n_recv, capacity: C, scale: {per: token, buffer: s_recv}}
  - use:  {op: external, reads: [q_recv, s_recv, n_recv], writes: [y]}
  - done: {op: barrier}
"""


@pytest.mark.parametrize("case", ["safe", "scales_read_early"])
def test_a_cast_s_row_scales_are_in_flight_too(case: str) -> None:
    """A per-token fp8 cast sends each row's scale along (s_recv, block r of every
    peer's): in flight from the put to its wait, as the rows are."""
    between = ("" if case == "safe" else
               "  - fill: {op: external, reads: [x_send], writes: [s_recv]}\n"
               "  - peek: {op: external, reads: [s_recv], writes: [y]}\n")
    want = set() if case == "safe" else {
        ("race", "write-after-read", "s_recv", "peek", "send"),
        ("race", "write-after-write", "s_recv", "fill", "send")}
    assert_three_agree(parse_text(CAST.replace("{between}", between)), want, case,
                       worlds=(2, 3))


def test_the_rows_land_at_the_wait_as_the_whole_op_moves_them() -> None:
    """The float64 reference: nothing lands at the put; at the wait every rank holds
    what the whole op gives (its counts too)."""
    split = parse_text(text(PUT, WORK, WAIT, DONE))
    whole = parse_text(text(WAIT.replace(", phase: wait", "").replace("recv:", "move:"),
                            WORK, DONE))
    g = torch.Generator().manual_seed(3)
    counts = [[2, 0, 4], [4, 1, 3], [0, 3, 2]]
    inputs = [{"x_send": torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
               .to(torch.bfloat16).double(),
               "counts": torch.tensor(counts[p], dtype=torch.int64),
               "other": torch.zeros(3, dtype=torch.int64),
               "w": torch.zeros(3, 4, 8, dtype=torch.float64)} for p in range(3)]

    def work(step: object, rank: int, bufs: dict) -> dict:
        return {"y": bufs["w"] + 1}

    trace: list = []
    got = simulate_call(split, 3, {"C": 4, "H": 8}, inputs, external=work, trace=trace)
    want = simulate_call(whole, 3, {"C": 4, "H": 8}, inputs, external=work)
    for j in range(3):
        assert seen_at(trace, 2, j, "x_recv") is None  # in flight: not yet landed
        assert seen_at(trace, 2, j, "n_recv") is None
        assert got[j]["n_recv"].tolist() == [counts[p][j] for p in range(3)]
        for name in ("x_recv", "n_recv"):
            assert torch.equal(got[j][name].nan_to_num(-1), want[j][name].nan_to_num(-1))


def test_the_put_only_pushes_and_the_wait_only_polls(tmp_path: Path) -> None:
    """The two kernels (templates/ops/ragged_all_to_all.py.j2): the put's stores the
    rows and releases, never waits; the wait's stores no row, waits, then checks."""
    from dcpc.harness.run import compile_to

    _, module, _, _ = compile_to(str(FILE), tmp_path, 2)
    code = Path(module).read_text()

    def kernel(name: str) -> str:
        start = code.index(f"def _{name}_kernel(")
        return code[start:code.index("\n@", start)]

    put, wait = kernel("send"), kernel("recv")
    assert "_dcpc_release(" in put and "_dcpc_wait(" not in put
    assert "_dcpc_wait(" in wait and "_dcpc_release(" not in wait
    assert "tl.store(dst" not in wait and "DCPC_OVER_CAPACITY" in wait


@pytest.mark.e2e
@pytest.mark.parametrize("world", [3, (2, 2)], ids=["W3", "deepep_2x2"])
def test_the_kernels_touch_what_the_plan_says(world: Any) -> None:
    """The access tracer (dcpc/harness/trace.py): the put's stores lie in block `rank`
    of every peer's dst and recv_counts before its signal, the wait's read of
    recv_counts after its wait (its first poll), in the split op file; and in DeepEP
    normal mode's pipelined chunks, whose hops send no count (the meta, an all_to_all,
    carries them): their stores and waits."""
    from dcpc.harness import trace as tr
    from dcpc.lang.mesh import MeshWorld

    path = FILE if world == 3 else ROOT / "schedules" / "gallery" / "deepep_normal.yaml"
    run = tr.run_traced(str(path), world if world == 3 else MeshWorld(world), programs=2,
                        block=256, calls=2 if world == 3 else 1)
    assert run.mismatches == 0 and run.problems == [], run.problems
    # each wait kernel launches on its put's grid (program i polls program i); a credit
    # (`op: wait`, DeepEP's ring heads) is no split exchange
    waits = {s.name: s.attrs["tune_of"] for s in run.plan.steps
             if s.attrs.get("signal") is False and s.op == "ragged_all_to_all"}
    assert waits, run.plan.steps
    for wait, put in waits.items():
        assert run.trace.programs[wait] == run.trace.programs[put] >= 2, (wait, put,
                                                                         run.trace.programs)


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "local"])
def test_the_split_file_matches_float64_on(backend: str) -> None:
    from dcpc.harness.run import RunConfig, format_report, run_schedule

    report = run_schedule(RunConfig(schedule=str(FILE), world=3, backend=backend, calls=4,
                                    seed=5))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert {"x_recv", "k_recv", "n_recv", "y_back", "n_back"} <= set(report.outputs), text


@pytest.mark.e2e
@pytest.mark.parametrize(("put", "wait"), [(3, 1), (1, 3)], ids=["put_3_wait_1", "put_1_wait_3"])
def test_the_wait_launches_on_the_put_s_grid_whatever_its_own_tuning(put: int,
                                                                     wait: int) -> None:
    """The put and its wait tuned to other programs: the wait launches its put's grid
    (program i polls program i), so every call finishes and matches float64 (a wait on
    its own grid of more programs than the put would wait for a signal never sent; of
    fewer, it would return before the put's other programs landed)."""
    from dcpc.harness.run import RunConfig, format_report, run_schedule

    tuned = tuple((f'"{step}": {{"programs": 128,', f'"{step}": {{"programs": {n},')
                  for step, n in (("send", put), ("recv", wait)))
    report = run_schedule(RunConfig(schedule=str(FILE), world=2, backend="local", calls=3,
                                    seed=11, programs=None, module_patch=tuned))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert {"x_recv", "k_recv", "n_recv", "y_back", "n_back"} <= set(report.outputs), text


def _over_capacity_child() -> None:
    """W = 2 ranks as threads (the kernels on the local backend): rank 0 routes 5 rows to
    rank 1 under capacity 4, with the move split; each rank calls the put, then the wait."""
    import tempfile

    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.local import LocalGroup

    def rank_main(rank: Any, path: str) -> str:
        module = load_module_class(path, "rags")(rank, sizes={"C": 4}, device="cpu",
                                                 backend="local", timeout_s=20)
        x = torch.randn(2, 4, 8).bfloat16()
        counts = torch.tensor([1, 5 if rank.rank == 0 else 2], dtype=torch.int32)
        done = []
        try:
            module.send(x, counts)
            done.append("put returned")
            module.recv()
            done.append("wait returned")
        except Exception as exc:  # noqa: BLE001 (the test reads what each rank raised)
            done.append(f"{type(exc).__name__}: {exc}")
        finally:
            module.close()
        return " | ".join(done)

    with tempfile.TemporaryDirectory(prefix="dcpc-rags-") as tmp:
        src = Path(tmp) / "rags.yaml"
        src.write_text(text(PUT, WAIT))
        _, module, _, _ = compile_to(str(src), Path(tmp), 2)
        print("RESULT " + json.dumps(LocalGroup(2, "cpu", timeout_s=60).run(rank_main, module)))


@pytest.mark.e2e
def test_a_count_over_capacity_fails_the_put_and_its_wait() -> None:
    """The sender's kernel records the error at the put (its call raises); the receiver,
    whose put returned, fails at its wait: the count it found, or the peer's flag."""
    ranks = child_result(__file__, "over")
    assert ranks[0].startswith("DcpcArgumentError: step 'send': rank 0's counts[1] = 5, "
                               "over the capacity 4"), ranks
    assert ranks[1].startswith("put returned | "), ranks
    assert ranks[1].split(" | ")[1].startswith((
        "DcpcArgumentError: step 'recv': peer 0 routed 5 rows to rank 1, over the capacity 4",
        "DcpcPeerFailedError: step 'recv': rank 1 stopped waiting for peer 0")), ranks


SHIFTS = """\
schedule: shifts
sizes: {C: {max: 4}, H: 8}
buffers:
  x_send: {shape: [C, H], dtype: bf16}
  x_recv: {shape: [C, H], dtype: bf16, symmetric: true}
steps:
  - send: {op: shift, src: x_send, dst: x_recv, offset: next, phase: put}
  - recv: {op: shift, src: x_send, dst: x_recv, offset: next, phase: wait}
"""
GATHERS = SHIFTS.replace("schedule: shifts", "schedule: gathers").replace(
    "[C, H], dtype: bf16, symmetric", "[W*C, H], dtype: bf16, symmetric").replace(
    "op: shift", "op: all_gather").replace(", offset: next", "")
PARTS = """\
schedule: parts
sizes: {C: {max: 4}, H: 8}
buffers:
  x_send: {shape: [C, H], dtype: bf16}
  x_recv: {shape: [W, C, H / W], dtype: bf16, symmetric: true}
  x_sum:  {shape: [C, H / W], dtype: bf16}
steps:
"""
SPLIT = {"all_to_all": "{op: all_to_all, src: x_send, dst: x_recv, dim: 1, phase: %s}",
         "reduce_scatter": "{op: reduce_scatter, src: x_send, dst: x_sum, dim: 1, phase: %s}"}
HANDSHAKE_S = 60.0  # the module's bound on a wait for a peer; gloo's is longer


def handshake_worker(rank: int, world: int, path: str, case: str, done: str) -> dict[str, Any]:
    """torch backend (gloo), W = 2 processes, put then wait: ``sizes``: rank 1 calls the
    put with C = 3, rank 0 with C = 4; ``failed``: rank 1's instance fails before the
    put (an f32 src where bf16 is declared), rank 0 calls the put as it should."""
    import time
    import warnings

    import torch.distributed as dist
    from support.kernels import load, the_class

    warnings.filterwarnings("ignore")
    module = the_class(load(path))(dist.group.WORLD, sizes={"C": 4}, device="cpu",
                                   backend="torch", timeout_s=HANDSHAKE_S)
    ragged = "rags" in Path(path).name
    x = torch.zeros(*[2] * ragged, 3 if case == "sizes" and rank == 1 else 4, 8,
                    dtype=torch.bfloat16)
    if case == "failed" and rank == 1:
        x = x.float()
    start, got = time.monotonic(), {}
    try:
        module.send(x, *[torch.tensor([1, 1], dtype=torch.int32)] * ragged)
        module.recv()
        got["error"] = None
    except Exception as exc:  # noqa: BLE001 (the test reads what each rank raised)
        got["error"] = f"{type(exc).__name__}: {exc}"
    got["seconds"] = time.monotonic() - start
    # rank 1 stays until rank 0 has its answer (a process gone would answer it instead;
    # a failed instance leaves no gloo pair to wait on)
    if rank == 0:
        Path(done).touch()
    while not Path(done).exists() and time.monotonic() - start < 4 * HANDSHAKE_S:
        time.sleep(0.1)
    module.close()
    return got


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["sizes", "failed"])
@pytest.mark.parametrize("op", ["ragged", "shift", "all_gather", "all_to_all",
                                "reduce_scatter"])
def test_the_torch_put_handshakes_before_it_moves(op: str, case: str, tmp_path: Path) -> None:
    """The torch backend moves the data at the put (a blocking exchange, a split
    ragged_all_to_all's, shift's, all_gather's, all_to_all's or reduce_scatter's): the
    handshake (fingerprint, failure notice, bounded wait per peer) runs there, before
    it, so ranks that bound other sizes fail naming the put, not in gloo, and a peer
    that failed earlier is named within the module's bound, not at gloo's timeout."""
    from support.kernels import compile_text

    from dcpc.harness.launch import launch

    source = {"ragged": text(PUT, WAIT), "shift": SHIFTS, "all_gather": GATHERS}.get(op) or (
        PARTS + "".join(f"  - {name}: {SPLIT[op] % phase}\n"
                        for name, phase in (("send", "put"), ("recv", "wait"))))
    path = str(compile_text(source, tmp_path, (2,)))
    result = launch("test_ragged_split:handshake_worker", 2,
                    {"path": path, "case": case, "done": str(tmp_path / "done")},
                    timeout_s=400, gloo_timeout_s=4 * HANDSHAKE_S)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    ranks = result.values()
    if case == "sizes":
        for rank, got in enumerate(ranks):
            assert got["error"].startswith(
                f"DcpcContractError: step 'send': rank {rank}'s call differs from peer "
                f"{1 - rank}'s: "), ranks
            assert "C" in got["error"], ranks
    else:
        assert ranks[1]["error"].startswith("DcpcArgumentError: "), ranks
        assert ranks[0]["error"].startswith(
            "DcpcPeerFailedError: step 'send': rank 0 stopped waiting for peer 1"), ranks
        assert ranks[0]["seconds"] < HANDSHAKE_S, ranks


if __name__ == "__main__" and sys.argv[1:] == ["over"]:
    _over_capacity_child()
