"""ragged_all_to_all with ``groups`` (DeepEP's low-latency layout: a slot of C rows and a
count per (local expert, source)): the kernel (ranks as threads, the ``local`` backend)
lands each slot where the layout says, checked here by hand rather than against the
simulator; ``groups: 1`` is the plain form bit for bit; counts of 0 and at the
capacity; a count over it refused on the sender and the receiver with the op's error;
the torch backend's layout and refusal. The float64 runs of every backend (and the
split phase) are schedules/ops/ragged_all_to_all_groups.yaml's."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.kernels import run_threads

from dcpc.runtime.errors import DcpcArgumentError

W, L, C, H = 2, 3, 3, 8  # W != L: a peer and a group swapped fail

GROUPED = """\
schedule: grouped
sizes: {C: {max: 3}, L: 3, H: 8}
buffers:
  x:  {shape: [W, L*C, H], dtype: bf16}
  k:  {shape: [W, L*C], dtype: i32}
  n:  {shape: [W, L], dtype: i32}
  y:  {shape: [L, W*C, H], dtype: bf16, symmetric: true}
  q:  {shape: [L, W*C], dtype: i32, symmetric: true}
  m:  {shape: [L, W], dtype: i32, symmetric: true}
steps:
  - move: {op: ragged_all_to_all, src: [x, k], dst: [y, q], counts: n, recv_counts: m,
           capacity: C, groups: L}
"""

ONE = GROUPED.replace("L: 3", "L: 1")
# the plain form: the same step without groups (dst [W, C, H], counts [W])
PLAIN = GROUPED
for _old, _new in (("L: 3, ", ""), ("[W, L*C", "[W, C"), ("[L, W*C", "[W, C"),
                   ("[W, L]", "[W]"), ("[L, W]", "[W]"), (", groups: L", "")):
    PLAIN = PLAIN.replace(_old, _new)


def _payload(rank: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(*shape, H, generator=gen).bfloat16()
    return x, torch.arange(x[..., 0].numel(), dtype=torch.int32).reshape(shape) + 100 * rank


def _run(text: str, call: Callable[[Any, int], Any]) -> list[Any]:
    """``call(instance, rank)`` on every rank of a W-rank local group, its result or the
    error it raised (str)."""
    return run_threads(text, "grouped", W, {"C": C}, call)


# counts[p][j, e]: rows rank p sends rank j's expert e; 0 and C (full) on both ranks
COUNTS = [[[0, C, 1], [2, 1, C]], [[C, 1, 2], [0, C, 1]]]


def test_each_slot_lands_in_its_expert_block_at_its_source_rows() -> None:
    """Rows [0, n) of slot (j, e) of rank p land in y[e, p * C ..] of rank j, their ids
    beside them, and n in m[e, p] (DeepEP's packed_recv_x [L, W * C, H] and the counts
    of its packed_recv_layout_range); counts of 0 and at the capacity."""
    def call(inst: Any, rank: int) -> Any:
        x, k = _payload(rank, (W, L * C))
        return inst.move(x, k, torch.tensor(COUNTS[rank], dtype=torch.int32))

    got = _run(GROUPED, call)
    for j, (y, q, m) in enumerate(got):
        assert m.tolist() == [[COUNTS[p][j][e] for p in range(W)] for e in range(L)]
        for p in range(W):
            x, k = _payload(p, (W, L * C))
            for e in range(L):
                n = COUNTS[p][j][e]
                assert torch.equal(y[e, p * C:p * C + n], x[j, e * C:e * C + n]), (j, p, e)
                assert torch.equal(q[e, p * C:p * C + n], k[j, e * C:e * C + n]), (j, p, e)


def test_one_group_is_the_plain_form_bit_for_bit() -> None:
    """``groups: 1`` (dst [1, W * C, H], counts [W, 1], recv_counts [1, W]) moves the
    same bytes as the plain form (dst [W, C, H], counts [W]): the same memory layout."""
    def call(shape: tuple[int, ...]) -> Callable[[Any, int], Any]:
        def run(inst: Any, rank: int) -> Any:
            x, k = _payload(rank, (W, C))
            n = torch.tensor([COUNTS[rank][j][1] for j in range(W)], dtype=torch.int32)
            return inst.move(x, k, n.reshape(shape))
        return run

    one, plain = _run(ONE, call((W, 1))), _run(PLAIN, call((W,)))
    for (y1, q1, m1), (y0, q0, m0) in zip(one, plain, strict=True):
        assert m1.reshape(-1).tolist() == m0.tolist()
        for p, n in enumerate(m0.tolist()):  # the live rows: the rest was never written
            rows = slice(p * C, p * C + n)
            assert torch.equal(y1.reshape(W * C, H)[rows].view(torch.int16),
                               y0.reshape(W * C, H)[rows].view(torch.int16))
            assert torch.equal(q1.reshape(-1)[rows], q0.reshape(-1)[rows])


def test_a_count_over_capacity_fails_sender_and_receiver() -> None:
    def call(inst: Any, rank: int) -> Any:
        x, k = _payload(rank, (W, L * C))
        counts = torch.tensor(COUNTS[rank], dtype=torch.int32)
        if rank == 1:
            counts[0, 1] = C + 1  # rank 0's expert 1: counts' index 1
        return inst.move(x, k, counts)

    ranks = _run(GROUPED, call)
    assert ranks[1].startswith(f"step 'move': rank 1's counts[1] = {C + 1} (the rows for "
                               f"rank 0), over the capacity {C}; no row of that part was "
                               "sent"), ranks
    assert ranks[0].startswith(f"step 'move': peer 1 routed {C + 1} rows to rank 0, over the "
                               f"capacity {C}") or "peer 1 failed" in ranks[0], ranks


@pytest.mark.parametrize("combine", [False, True])
def test_the_torch_backend_lays_out_the_slots_and_refuses_over_capacity(
        combine: bool) -> None:
    """One rank (the exchange is a copy): a dispatch puts slot (0, e) at dst[e]; a combine
    puts src[e] back into slot (0, e); a count over the capacity raises before anything
    moves, naming its index in counts."""
    from dcpc.runtime import collectives

    one = collectives.SlotGroup(None, 0, 0, None)
    groups = 3
    src = torch.randn(groups * C, H) if not combine else torch.randn(groups, C, H)
    src = src.reshape((1, groups * C, H) if not combine else (groups, C, H))
    counts = torch.tensor([2, 0, C], dtype=torch.int32)
    dst = torch.full((groups, C, H) if not combine else (1, groups * C, H), -7.0)
    recv = torch.zeros(groups, dtype=torch.int32)
    collectives.ragged_all_to_all(one, src, counts, dst, recv, C, 1, "move",
                                  groups=groups, combine=combine)
    assert recv.tolist() == counts.tolist()
    for e, n in enumerate(counts.tolist()):
        assert torch.equal(dst.reshape(groups, C, H)[e, :n], src.reshape(groups, C, H)[e, :n])
        assert bool((dst.reshape(groups, C, H)[e, n:] == -7.0).all())  # never written
    counts[1] = C + 1
    with pytest.raises(DcpcArgumentError, match=rf"step 'move': rank 0's counts\[1\] = "
                       rf"{C + 1} \(the rows for rank 0\), over the capacity {C}"):
        collectives.ragged_all_to_all(one, src, counts, dst, recv, C, 1, "move",
                                      groups=groups, combine=combine)


@pytest.mark.parametrize("combine", [False, True])
def test_the_torch_backend_stages_on_the_tensors_device(combine: bool) -> None:
    """The staging tensors (the counts received, each payload's slots) are made on the
    tensors' device, not torch's default one: with a default device other than the
    tensors' (meta here, as cpu is on a CUDA run) the move still lands, counts and rows,
    in float and in the integer payload."""
    from dcpc.runtime import collectives

    one = collectives.SlotGroup(None, 0, 0, None)
    groups = 3
    src = torch.randn((1, groups * C, H) if not combine else (groups, C, H))
    ids = torch.arange(groups * C, dtype=torch.int32).reshape(src.shape[:2])
    counts = torch.tensor([1, C, 0], dtype=torch.int32)
    dst = torch.full((groups, C, H) if not combine else (1, groups * C, H), -7.0)
    ids_dst = torch.full(dst.shape[:2], -1, dtype=torch.int32)
    recv = torch.zeros(groups, dtype=torch.int32)
    with torch.device("meta"):
        collectives.ragged_all_to_all(one, src, counts, dst, recv, C, 1, "move",
                                      more=[(ids, ids_dst)], groups=groups, combine=combine)
    assert recv.tolist() == counts.tolist()
    for e, n in enumerate(counts.tolist()):
        assert torch.equal(dst.reshape(groups, C, H)[e, :n], src.reshape(groups, C, H)[e, :n])
        assert torch.equal(ids_dst.reshape(groups, C)[e, :n], ids.reshape(groups, C)[e, :n])


def test_the_torch_backend_runs_the_conformance_file_against_float64() -> None:
    """Gloo at W = 3 (the conformance suite runs the host backend): a grouped dispatch
    with its cast and ids, and the split combine back, every output as float64 says."""
    from dcpc.harness.run import RunConfig, run_schedule

    path = Path(__file__).resolve().parents[2] / "schedules/ops/ragged_all_to_all_groups.yaml"
    report = run_schedule(RunConfig(str(path), world=3, backend="torch", calls=3))
    assert report.ok, report.errors()


# the grouped combine back: src [L, W*C, H], counts [L, W]; dst [W, L*C, H], [W, L]
COMBINE = GROUPED
for _old, _new in (("[W, L*C", "[T, W*C"), ("[L, W*C", "[W, L*C"), ("[T, W*C", "[L, W*C"),
                   ("[W, L]", "[T, W]"), ("[L, W]", "[W, L]"), ("[T, W]", "[L, W]"),
                   ("groups: L}", "groups: L, direction: combine}")):
    COMBINE = COMBINE.replace(_old, _new)


def over_capacity_worker(rank: int, world: int, path: str, bad: list[list[int]],
                         combine: bool) -> str:
    """torch backend (gloo): every rank's counts over the capacity at its own ``bad``
    entry (so no rank waits on one that raised): what its call raised."""
    import torch.distributed as dist
    from support.kernels import load, the_class

    module = the_class(load(path))(dist.group.WORLD, sizes={"C": C}, device="cpu",
                                   backend="torch", timeout_s=60)
    lead, rows = (L, W) if combine else (W, L)
    x, k = _payload(rank, (lead, rows * C))
    counts = torch.ones(lead, rows, dtype=torch.int32)
    counts[tuple(bad[rank])] = C + 1
    try:
        module.move(x, k, counts)
        return "no error"
    except DcpcArgumentError as exc:
        return str(exc)
    finally:
        module.close()


@pytest.mark.parametrize(("text", "bad", "peers"), [
    # dispatch counts [W, L]: (j, e), index j*L + e; rank 0's [1, 1] is for rank 1
    (GROUPED, [[1, 1], [0, 1]], [1, 0]),
    # combine counts [L, W]: (e, j), index e*W + j
    (COMBINE, [[0, 1], [2, 0]], [1, 0]),
], ids=["dispatch", "combine"])
def test_the_torch_backend_names_the_peer_of_a_count_over_capacity(
        text: str, bad: list[list[int]], peers: list[int], tmp_path: Path) -> None:
    """Gloo at W = 2, L = 3: the error names the counts index and the rank those rows
    were for (entries whose index // L and index % W name different ranks; the rank is
    left out where it is the index)."""
    from support.kernels import compile_text

    from dcpc.harness.launch import launch

    path = str(compile_text(text, tmp_path, (W,)))
    result = launch("test_ragged_groups:over_capacity_worker", W,
                    {"path": path, "bad": bad, "combine": text is COMBINE}, timeout_s=400)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    for rank, got in enumerate(result.values()):
        index = bad[rank][0] * (W if text is COMBINE else L) + bad[rank][1]
        peer = f" (the rows for rank {peers[rank]})" if index != peers[rank] else ""
        assert got.startswith(f"step 'move': rank {rank}'s counts[{index}] = {C + 1}{peer}, "
                              f"over the capacity {C}"), got


CONFORMANCE = Path(__file__).resolve().parents[2] / "schedules/ops/ragged_all_to_all_groups.yaml"
# the grouped dispatch split, and a step between its put and its wait reading what lands
EARLY = (("  - experts:  {op: external", "  - recv:     {op: ragged_all_to_all, src: [x_send, "
          "k_send], dst: [x_recv, k_recv], counts: counts, recv_counts: n_recv, capacity: C, "
          "groups: L, direction: dispatch, scale: {per: token, buffer: s_recv}, phase: wait}\n"
          "  - experts:  {op: external"),
         ("direction: dispatch, scale: {per: token, buffer: s_recv}}",
          "direction: dispatch, scale: {per: token, buffer: s_recv}, phase: put}\n"
          "  - peek:     {op: external, reads: [x_recv], writes: [o]}"))


@pytest.mark.parametrize("early", [False, True], ids=["conformance", "read_before_landed"])
def test_the_checker_and_both_oracles_agree_on_grouped_layouts(early: bool) -> None:
    """A grouped dispatch stores block `rank` of dim 1 of every peer's dst [L, W*C, H]
    (and index `rank` of dim 1 of recv_counts): the checker, the brute force
    (tests/support/hb_oracle.py) and the execution oracle say the same, clean for the
    conformance file, a race for a read of x_recv between a split dispatch's put and
    its wait."""
    from support.exec_oracle_agree import disagreements
    from support.hb_oracle import oracle_keys

    from dcpc.check import hb
    from dcpc.lang.parse import parse_text

    text = CONFORMANCE.read_text()
    if early:
        for old, new in EARLY:
            assert old in text
            text = text.replace(old, new, 1)
    schedule = parse_text(text, "groups.yaml")
    for world in (2, 3):
        findings = hb.check(schedule, [world], hints=False).findings
        found = {f.key for f in findings}
        assert found == oracle_keys(schedule, world), world
        assert bool(found) == early and all(k[2] == "x_recv" for k in found), found
        # the store's part in words: one block of dim 1 (no leading space)
        assert all(re.match(r"x_recv\[rank \d, slot 0\] block \d \(dim 1\), in flight",
                            f.second.region) for f in findings), findings
    assert disagreements(schedule, [2, 3]) == []


@pytest.mark.parametrize(("old", "new", "where", "words"), [
    ("n:  {shape: [W, L]", "n:  {shape: [W]", "counts: n",
     "counts 'n' of step 'move' has 1 dims [W] but must have 2, [W, L] (one row count "
     "per (peer, group))"),
    ("y:  {shape: [L, W*C, H]", "y:  {shape: [W, L*C, H]", "dst: [y",
     "dst 'y' of step 'move' has shape [W, L*C, H] but must be [L, W*C, H] (one slot of "
     "capacity rows per (peer, group), rows as in src 'x')"),
    ("groups: L}", "groups: L, direction: combine}", "src: [x",
     "src 'x' of step 'move' has shape [W, L*C, H] but must be [L, W*C, H]"),
])
def test_a_grouped_shape_that_is_not_the_layout_is_located(old: str, new: str, where: str,
                                                           words: str) -> None:
    """The plain form's shapes under ``groups`` (or a dispatch's under ``direction:
    combine``) are shape-mismatch on the buffer's entry in the step, saying the layout."""
    from support.schedules import check_errors

    text = GROUPED.replace(old, new)
    found = [e for e in check_errors(text) if words in e.message]
    assert found and found[0].code == "shape-mismatch", [e.message for e in check_errors(text)]
    line = next(i for i, t in enumerate(text.splitlines(), 1) if where in t)
    col = text.splitlines()[line - 1].index(where) + len(where)  # the name's (1-based)
    assert (found[0].mark.line, found[0].mark.col) == (line, col), found[0]


@pytest.mark.parametrize(("old", "new", "key"), [("capacity: C,", "capacity: C +,", "capacity"),
                                                 ("groups: L}", "groups: L +}", "groups")])
def test_a_size_that_does_not_parse_is_located(old: str, new: str, key: str) -> None:
    """capacity or groups that is not a size expression: a located shape-syntax on its
    value (it was an internal error with a traceback hint)."""
    from support.schedules import check_errors

    text = GROUPED.replace(old, new)
    (found,) = check_errors(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if new in t)
    col = text.splitlines()[line - 1].index(new) + len(key) + 3
    assert (found.code, found.mark.line, found.mark.col) == ("shape-syntax", line, col)
    assert f"{key} '{new.split(': ')[1].rstrip(',}')}' of step 'move' is not a size " \
        "expression" in found.message, found.message


@pytest.mark.parametrize(("text", "old", "new", "key", "words"), [
    (GROUPED, "groups: L}", "groups: 0}", "groups",
     "groups 0 of step 'move': groups must be >= 1"),
    (GROUPED, "groups: L}", "groups: -1}", "groups",
     "groups -1 of step 'move': groups must be >= 1"),
    (PLAIN, "capacity: C}", "capacity: C, direction: combine}", "direction",
     "step 'move' has 'direction: combine' but no 'groups'"),
], ids=["zero", "negative", "combine_without_groups"])
def test_groups_below_one_and_a_combine_without_groups_are_located(
        text: str, old: str, new: str, key: str, words: str) -> None:
    """One bad-counts on the value, with a hint (not the six shape errors a layout of 0 or
    -1 slots per peer would make, nor a combine silently taken for the plain form)."""
    from support.schedules import check_errors

    assert old in text
    text = text.replace(old, new)
    (found,) = check_errors(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if f"{key}: " in t)
    col = text.splitlines()[line - 1].index(f"{key}: ") + len(key) + 3
    assert (found.code, found.mark.line, found.mark.col) == ("bad-counts", line, col), found
    assert words in found.message and found.hint, found


def test_a_wait_matches_its_put_by_the_groups_expression_not_its_spelling() -> None:
    """The split combine's put with `groups: 1*L`, its wait with `groups: 1 * L`: the same
    put (clean, as the conformance file is); `groups: L + 0` on the wait is another."""
    from support.schedules import check_errors

    put = "capacity: C, groups: L, direction: combine, phase: put}"
    wait = "capacity: C, groups: L, direction: combine, phase: wait}"
    text = CONFORMANCE.read_text()
    assert put in text and wait in text
    spaced = text.replace(put, put.replace("L,", "1*L,")).replace(
        wait, wait.replace("L,", "1 * L,"))
    assert check_errors(spaced) == []
    other = text.replace(put, put.replace("L,", "1*L,")).replace(
        wait, wait.replace("L,", "L + 0,"))
    assert {e.code for e in check_errors(other)} == {"unmatched-wait", "unmatched-put"}


def test_counts_of_a_float_dtype_under_groups_say_one_per_peer_and_group() -> None:
    from support.schedules import check_errors

    text = GROUPED.replace("n:  {shape: [W, L], dtype: i32}", "n:  {shape: [W, L], dtype: f32}")
    found = [e for e in check_errors(text) if e.code == "bad-counts"]
    assert [e.message for e in found] == [
        "counts 'n' of step 'move' is f32; row counts are integers, one per (peer, group)"]
    assert found[0].hint == "declare 'n' as {shape: [W, L], dtype: i32}", found[0].hint
