"""Integer payloads (issue 33): the moves carry i32/i64 buffers bit for bit, the ops
that compute refuse them at the buffer's reference (file:line:col, naming the op and the
dtype); the harness draws integer payloads over the whole range and compares them as
integers (the runs themselves: schedules/ops/*_int.yaml in tests/ops/test_op_schedules.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from support.schedules import errors, write

from dcpc.harness import simulate, synth
from dcpc.harness.worker import OutputStats, compare
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
OPS_DIR = ROOT / "schedules" / "ops"


def retype(text: str, names: list[str], dtype: str) -> str:
    """``text`` with buffers ``names`` declared as ``dtype``."""
    for name in names:
        text, n = re.subn(rf"^(  {name}:\s*\{{.*dtype: )\w+", rf"\g<1>{dtype}", text,
                          flags=re.M)
        assert n == 1, name
    return text


def where(text: str, step: str, key: str, name: str) -> tuple[int, int]:
    """(line, col), 1-based, of ``key: name`` in step ``step`` (the first at or after
    the step's line)."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"  - {step}:"))
    for i in range(first, len(lines)):
        col = lines[i].find(f"{key}: {name}")
        if col >= 0:
            return i + 1, col + len(key) + 3
    raise AssertionError(f"{key}: {name} not in step {step}")


# (ops file, buffers made integer, dtype, the refusal: (code, step, key, buffer, kind))
MATH = [
    ("all_reduce", ["x", "x_sum"], "i32", ("non-float-output", "total", "dst", "x_sum",
                                           "all_reduce")),
    ("all_reduce", ["m", "m_recv", "m_max"], "i64", ("non-float-output", "largest", "dst",
                                                      "m_max", "all_reduce")),
    ("reduce", ["x", "x_sum"], "i64", ("non-float-output", "to_one", "dst", "x_sum",
                                       "reduce")),
    ("reduce_scatter", ["y_part", "y_shard"], "i32", ("non-float-output", "scatter_cols",
                                                      "dst", "y_shard", "reduce_scatter")),
    ("reduce_scatter", ["z_part", "z_recv", "z_shard"], "i64",
     ("non-float-output", "scatter_rows", "dst", "z_shard", "reduce_scatter")),
    ("lse_combine", ["out"], "i32", ("non-float-output", "merge", "dst", "out",
                                     "lse_combine")),
    ("all_to_all_combine", ["out"], "i64", ("non-float-output", "combine", "dst", "out",
                                            "all_to_all_combine")),
    ("all_reduce_lse", ["out_all"], "i32", ("non-float-output", "merged_all", "dst",
                                            "out_all", "all_reduce")),
    ("weighted_combine", ["dense", "out_dense"], "i32",
     ("non-float-output", "combine_dense", "dst", "out_dense", "weighted_combine")),
    ("all_to_all_cast", ["x"], "i32", ("bad-cast", "quant_token", "scale", "{per",
                                       "all_to_all")),
    ("ragged_all_to_all_cast", ["x_send"], "i64", ("bad-cast", "dispatch_token", "scale",
                                                   "{per", "ragged_all_to_all")),
]


@pytest.mark.parametrize(("file", "names", "dtype", "want"), MATH,
                         ids=[f"{f}-{n[-1]}" for f, n, _, _ in MATH])
def test_ops_that_compute_refuse_integers(tmp_path: Path, file: str, names: list[str],
                                          dtype: str, want: tuple[str, ...]) -> None:
    """reduce_scatter took integers (summed in fp32) and a merge's message named no op:
    each refusal now sits at the buffer's reference in the step and names op and dtype."""
    code, step, key, name, kind = want
    text = retype((OPS_DIR / f"{file}.yaml").read_text(), names, dtype)
    found = errors(write(tmp_path, text, f"{file}.yaml"), worlds=(2, 3))
    line, col = where(text, step, key, name)
    hits = [f for f in found if f[:3] == (code, line, col)]
    assert hits, (found, (code, line, col))
    assert f"{kind} '{step}'" in hits[0][3] and dtype in hits[0][3], hits[0][3]


def test_integer_payloads_are_drawn_over_the_whole_range() -> None:
    """A moved integer payload: negatives, i64 values past 2**53, the range's edges,
    never -1 (the poison); counts stay within their capacity."""
    schedule = parse_file(OPS_DIR / "ragged_all_to_all_int.yaml", 2)
    assert synth.payload_ints(schedule) == {"ids_send", "y"}  # not counts, not recv_counts
    schedule = parse_file(OPS_DIR / "all_gather_int.yaml", 2)
    assert synth.payload_ints(schedule) == {"ids", "rows", "blk"}
    sizes = synth.call_sizes(schedule, 2, synth.constructor_sizes(schedule, 2), 0, 0)
    inputs = synth.call_inputs(schedule, 2, sizes, 0, 0)
    for rank in inputs:
        rows, ids = rank["rows"], rank["ids"]
        assert rows.dtype == ids.dtype == torch.int64
        assert {2**63 - 1, -2**63, 2**53 + 1, -(2**53 + 1)} <= set(rows.flatten().tolist())
        assert int((rows.abs() > 2**53).sum()) > rows.numel() // 2
        assert ids.min() == -2**31 and ids.max() == 2**31 - 1 and (ids < 0).any()
        for value in (rows, ids, rank["blk"]):
            assert not (value == simulate.UNSENT_INT).any()
    assert not torch.equal(inputs[0]["rows"], inputs[1]["rows"])  # per rank
    ragged = parse_file(OPS_DIR / "ragged_all_to_all_int.yaml", 2)
    sizes = synth.call_sizes(ragged, 2, synth.constructor_sizes(ragged, 2), 0, 0)
    counts = synth.call_inputs(ragged, 2, sizes, 0, 0)[0]["counts"]
    assert 0 <= int(counts.min()) and int(counts.max()) <= sizes["C"]


def test_integers_compare_bit_for_bit() -> None:
    """Through float64 2**53 + 1 read as 2**53: an integer is compared as an integer;
    a ragged buffer's unsent rows (UNSENT_INT in the reference) are skipped."""
    want = torch.tensor([2**53 + 1, -5, 7], dtype=torch.int64)
    stats = OutputStats()
    compare("x", "move", "i64", torch.tensor([2**53, -5, 7]), want, stats, "here")
    assert stats.mismatches == 1 and "9007199254740992" in stats.first_mismatch
    stats = OutputStats()
    compare("x", "move", "i64", want.clone(), want, stats, "here")
    assert stats.mismatches == 0 and stats.compared == 1
    unsent = torch.tensor([2**53 + 1, simulate.UNSENT_INT, 7])
    stats = OutputStats()
    compare("x", "move", "i32", torch.tensor([2**53 + 1, 12345, 7]), unsent, stats, "here",
            unsent=torch.tensor([False, True, False]))
    assert stats.mismatches == 0
    compare("x", "move", "i32", torch.tensor([2**53 + 1, 12345, 7]), unsent, stats, "here")
    assert stats.mismatches == 1


def test_references_move_integers_exactly() -> None:
    """The reference of each move keeps int64 (an interleaved all_gather went through
    float64); a ragged integer payload's unsent rows hold UNSENT_INT, the live ones the
    sender's rows."""
    for name in ("all_gather_int", "all_to_all_int", "broadcast_int", "ragged_all_to_all_int"):
        schedule = parse_file(OPS_DIR / f"{name}.yaml", 3)
        ctor = synth.constructor_sizes(schedule, 3)
        sizes = synth.call_sizes(schedule, 3, ctor, 0, 0)
        inputs = synth.call_inputs(schedule, 3, sizes, 0, 0)
        external = synth.make_external(schedule, 3, sizes, 0, 0)
        out = simulate.simulate_call(schedule, 3, sizes, inputs, external)
        if name == "all_gather_int":
            for r in range(3):
                got = out[r]["blk_all"].reshape(-1, 3, 2)  # blocks of I = 3 rows, W = 3
                for p in range(3):  # rank p's blocks: every W-th from block p
                    assert torch.equal(got[p::3].reshape(-1, 2), inputs[p]["blk"])
                assert torch.equal(out[r]["rows_all"], torch.cat([i["rows"] for i in inputs]))
        if name == "ragged_all_to_all_int":
            for j in range(3):
                recv = out[j]["ids_recv"]
                assert recv.dtype == torch.int64
                for p in range(3):
                    n = int(inputs[p]["counts"][j])
                    assert torch.equal(recv[p, :n], inputs[p]["ids_send"][j, :n])
                    assert (recv[p, n:] == simulate.UNSENT_INT).all()
        for rank in out:
            for buf, value in rank.items():
                if not schedule.buffers[buf].dtype.is_float:
                    assert value.dtype == torch.int64, (name, buf)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bfloat16])
def test_poison_of_a_strided_tensor(dtype: torch.dtype) -> None:
    """A strided tensor is filled, not poisoned through its bytes: an integer one was
    filled with NaN, which it cannot hold (RuntimeError); now -1, its 0xFF bytes."""
    from dcpc.runtime.heap import poison_

    whole = torch.zeros(4, 6, dtype=dtype)
    poison_(whole[:, :3])
    poisoned = whole[:, :3].isnan() if dtype.is_floating_point else whole[:, :3] == -1
    assert poisoned.all() and (whole[:, 3:] == 0).all()


def test_the_docs_name_the_moves_that_carry_integers() -> None:
    """docs/language.md's integer table: the ops whose `src` and `dst` may be integers
    are the moves the harness compares bit for bit (synth.is_move), no more, no fewer."""
    from dcpc.ops import OPS

    text = (ROOT / "docs" / "language.md").read_text()
    table = text[text.index("| op | integer buffers |"):].split("\n\n", 1)[0]
    listed = set()
    for row in table.splitlines()[2:]:
        op, buffers = row.split(" | ")[0:2]
        if buffers.startswith("`src` and `dst`"):
            listed |= set(re.findall(r"`([a-z_]+)`", op))
    assert listed == {name for name, op in OPS.items() if op.exact and name != "external"}
