"""ragged_all_to_all, and all_to_all with a cast (its kernel), over a team (`axis:`,
issue 33): counts[j] is the rows for member j of the step's team, they land in block
`member` of member j's dst. The float64 reference says so on values by hand; the checker
proves the conformance file at several mesh shapes and agrees with the brute force and
the execution oracle on a twin whose credit runs over the other axis; a count over
capacity is reported with the module's GLOBAL ranks (the kernel's record held a member
index the runtime printed as a rank); the kernels and gloo match float64 at 2x2/2x3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.exec_oracle_agree import disagreements
from support.hb_oracle import MESH_SHAPES as SHAPES
from support.hb_oracle import oracle_keys

from dcpc.check import hb
from dcpc.cli import main
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.simulate import simulate_call
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "schedules" / "ops" / "ragged_all_to_all_axis.yaml"

HEAD = """\
schedule: rteam
slots: {slots}
mesh: {{node: N, gpu: G}}
sizes: {{N: {{max: 4}}, G: {{max: 4}}, C: {{max: 4}}, H: 8}}
buffers:
  x:  {{shape: [G, C, H], dtype: bf16}}
  n:  {{shape: [G], dtype: i32}}
  y:  {{shape: [G, C, H], dtype: {y}, symmetric: true}}
{s}  m:  {{shape: [G], dtype: i32, symmetric: true}}
  o:  {{shape: [G, C, H], dtype: bf16}}
steps:
  - move: {{op: ragged_all_to_all, axis: gpu, src: x, dst: y, counts: n, recv_counts: m,
           capacity: C{scale}}}
"""
USE = "  - use:  {op: external, reads: [y, m, s], writes: [o]}\n"


def text(credit: str | None = "gpu", slots: int = 1, cast: bool = True) -> str:
    tail = USE if cast else USE.replace(", s]", "]")
    if credit is not None:
        tail += f"  - free: {{op: barrier, axis: {credit}}}\n"
    return head(slots, cast) + tail


def head(slots: int = 1, cast: bool = False) -> str:
    if not cast:
        return HEAD.format(slots=slots, scale="", y="bf16", s="")
    return HEAD.format(slots=slots, scale=", scale: {per: token, buffer: s}", y="fp8e4m3",
                       s="  s:  {shape: [G, C], dtype: f32, symmetric: true}\n")


def test_reference_moves_within_each_team_by_member() -> None:
    """At 2x3 over gpu: member p's rows for member j land in block p of member j's dst,
    the count in its recv_counts[p]; nothing crosses a node."""
    schedule = parse_text(head(), "t.yaml")
    world = MeshWorld((2, 3))
    g = torch.Generator().manual_seed(3)
    counts = [[(r + j) % 5 for j in range(3)] for r in range(6)]
    inputs = [{"x": torch.randn(3, 4, 8, generator=g).bfloat16().double(),
               "n": torch.tensor(counts[r], dtype=torch.int64)} for r in range(6)]
    out = simulate_call(schedule, world, {"N": 2, "G": 3, "C": 4, "H": 8}, inputs,
                        external=None)  # type: ignore[arg-type]
    for node in range(2):
        for p in range(3):
            for j in range(3):
                src, dst = node * 3 + p, node * 3 + j
                n = counts[src][j]
                assert int(out[dst]["m"][p]) == n
                assert torch.equal(out[dst]["y"][p, :n].double(),
                                   inputs[src]["x"][j, :n]), (src, dst)
                assert bool(out[dst]["y"][p, n:].isnan().all())


def test_dcpc_check_proves_the_team_file_and_the_brute_force_agrees() -> None:
    got = CliRunner().invoke(main, ["check", str(FILE), "--world", "2x2,2x3,3x2,3x3,2x4"])
    assert got.exit_code == 0 and f"{FILE}: ok (W " in got.output, got.output
    for world in SHAPES:
        assert oracle_keys(parse_file(FILE, world), world) == set(), world


@pytest.mark.parametrize("cast", [False, True], ids=["plain", "fp8"])
def test_a_credit_over_the_other_axis_leaves_the_race(cast: bool) -> None:
    """The next call's pushes into y, m (and the row scales s) race the members' reads
    unless a barrier over gpu (the op's team) orders them; one over node does not: the
    checker, the brute force and the execution oracle say the same."""
    fixed, wrong = (parse_text(text(a, cast=cast), "c.yaml") for a in ("gpu", "node"))
    races = {("y", "use", "move"), ("m", "use", "move"), ("m", "move", "move"),
             ("y", "move", "move")}  # the engine reads what move returns, at its return
    if cast:
        races.add(("s", "use", "move"))
    for world in SHAPES:
        assert hb.check(fixed, [world], hints=False).findings == []
        assert oracle_keys(fixed, world) == set()
        keys = {f.key for f in hb.check(wrong, [world], hints=False).findings}
        assert keys == oracle_keys(wrong, world) == {
            ("race", "write-after-read", *race) for race in races}, world
    assert disagreements(wrong, SHAPES[:2]) == []
    assert disagreements(fixed, SHAPES[:2]) == []


def test_the_torch_collective_names_global_ranks() -> None:
    """A team's SlotGroup numbers members; the error names the module's ranks: member 1
    of the team (3, 5) is rank 5, and counts[1] is its count."""
    from dcpc.runtime import collectives
    from dcpc.runtime.errors import DcpcArgumentError

    comm = collectives.SlotGroup(None, 0, 0, None, 3, (5,), (3, 5))
    with pytest.raises(DcpcArgumentError, match=r"step 'move': rank 3's counts\[1\] = 7 "
                       r"\(the rows for rank 5\), over the capacity 4"):
        collectives.ragged_all_to_all(comm, torch.randn(2, 4, 8),
                                      torch.tensor([1, 7], dtype=torch.int32),
                                      torch.zeros(2, 4, 8), torch.zeros(2, dtype=torch.int32),
                                      4, 2, "move")


def test_a_count_over_capacity_in_a_team_names_the_global_ranks(tmp_path: Path) -> None:
    """2x2 over node (teams {0, 2} and {1, 3}): rank 1 routes 5 rows to member 1 of its
    team, rank 3, under capacity 4. The sender names counts[1] and rank 3; the receiver
    names peer 1 (the record held member 0, printed as 'peer 0': another rank)."""
    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.errors import DcpcArgumentError, DcpcPeerFailedError
    from dcpc.runtime.local import LocalGroup

    path = tmp_path / "rteam.yaml"
    path.write_text(text(cast=False).replace("axis: gpu, src", "axis: node, src")
                    .replace("[G", "[N"))
    _, module, _, _ = compile_to(str(path), tmp_path, MeshWorld((2, 2)))  # type: ignore[arg-type]

    def rank_main(rank: Any) -> str:
        inst = load_module_class(module, "rteam")(rank, sizes={"N": 2, "G": 2, "C": 4},
                                                  device="cpu", backend="local", timeout_s=20)
        counts = torch.tensor([1, 5 if rank.rank == 1 else 2], dtype=torch.int32)
        try:
            inst.move(torch.randn(2, 4, 8).bfloat16(), counts)
            return "no error"
        except (DcpcArgumentError, DcpcPeerFailedError) as exc:
            return str(exc)
        finally:
            inst.close()

    ranks = LocalGroup(4, "cpu", timeout_s=60).run(rank_main)
    assert ranks[1].startswith("step 'move': rank 1's counts[1] = 5 (the rows for rank 3), "
                               "over the capacity 4; no row of that part was sent"), ranks
    assert ranks[3].startswith("step 'move': peer 1 routed 5 rows to rank 3, over the "
                               "capacity 4") or "peer 1 failed" in ranks[3], ranks
    assert ranks[0] == ranks[2] == "no error", ranks  # the other team is untouched


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [((2, 2), "torch"), ((2, 3), "torch"),
                                                ((2, 2), "local"), ((3, 2), "local")])
def test_the_team_file_matches_float64(world: tuple[int, int], backend: str) -> None:
    """gloo (a process group per team) and the kernels (ranks as threads); the host
    backend runs the file in tests/ops/test_op_schedules.py."""
    w = MeshWorld(world)
    report = run_schedule(RunConfig(schedule=str(FILE), world=w, backend=backend, calls=3,
                                    seed=5))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    for name in ("x_rail", "q_recv", "n_recv", "y_back", "n_back", "z_recv"):
        assert report.outputs[name].compared == 3 * int(w), (name, text)


GALLERY = ROOT / "schedules" / "gallery" / "deepep_normal.yaml"
TWIN = ROOT / "tests" / "gallery_twins" / "deepep_normal.late_rdma_read.yaml"


@pytest.mark.parametrize("path", [GALLERY, TWIN], ids=["gallery", "late_rdma_read"])
def test_deepep_normal_checker_agrees_with_brute_force_and_execution(path: Path) -> None:
    """DeepEP normal mode (rail over node, NVLink over gpu, fp8 tokens with their scales,
    ids and weights in one hop, the forwarder's reduce into [N, C, H]) is clean; its
    twin, which reads the dispatch's RDMA receive buffer after the combine's rail hop,
    races there: checker = brute force = execution."""
    for world in SHAPES:
        schedule = parse_file(path, world)
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert found == oracle_keys(schedule, world), (path.name, world)
        assert bool(found) == (path == TWIN), found
        assert all(k[2] == "ids_rail_0" for k in found), found  # chunk 0: read late
    assert disagreements(parse_file(path, SHAPES[0]), SHAPES[:2]) == [], path.name


NO_HEAD = ROOT / "tests" / "gallery_twins" / "deepep_normal.no_rdma_head.yaml"


def ring_slots(tmp_path: Path, rdma: int, nvl: int,
               back: tuple[int, int] | None = None) -> Path:
    """The gallery file with R RDMA and V NVLink chunk slots per receive ring (P = 3), the
    combine's rings (RB, VB: their own sizes, as DeepEP's combine config) ``back`` or
    the same."""
    text = GALLERY.read_text()
    sized = text
    back_rdma, back_nvl = back or (rdma, nvl)
    for name, slots in (("R", rdma), ("V", nvl), ("RB", back_rdma), ("VB", back_nvl)):
        assert text.count(f"\n  {name}: 2 ") == 1, name
        sized = sized.replace(f"\n  {name}: 2 ", f"\n  {name}: {slots} ")
    assert "\n  P: 3 " in text
    path = tmp_path / f"deepep_normal_r{rdma}v{nvl}_rb{back_rdma}vb{back_nvl}.yaml"
    path.write_text(sized)
    return path


@pytest.mark.parametrize(("rdma", "nvl"), [(1, 1), (1, 3), (2, 1), (2, 3), (3, 1), (3, 3)])
def test_deepep_normal_rings_of_any_slot_count_are_proved(tmp_path: Path, rdma: int,
                                                          nvl: int) -> None:
    """Rings of R (RDMA) and V (NVLink) chunk slots, 1 <= R, V <= P = 3 (R = P: no refill
    hop, a loop of 0 hops): clean, and the brute force agrees at every shape."""
    path = ring_slots(tmp_path, rdma, nvl)
    for world in SHAPES[:2]:
        schedule = parse_file(path, world)
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert found == oracle_keys(schedule, world) == set(), (rdma, nvl, world, found)


@pytest.mark.parametrize(("rdma", "nvl", "back"), [(1, 3, (3, 1)), (3, 1, (1, 3))])
def test_deepep_normal_combine_rings_apart_from_the_dispatch_s_are_proved(
        tmp_path: Path, rdma: int, nvl: int, back: tuple[int, int]) -> None:
    """The combine's rings sized apart from the dispatch's (RB, VB: DeepEP's
    Buffer.get_combine_config), one slot where the other direction has P: clean, and
    the brute force agrees."""
    path = ring_slots(tmp_path, rdma, nvl, back)
    for world in SHAPES[:2]:
        schedule = parse_file(path, world)
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert found == oracle_keys(schedule, world) == set(), (rdma, nvl, back, world, found)


def test_deepep_normal_sender_without_the_rdma_head_overwrites_a_slot() -> None:
    """The twin whose RDMA sender refills slot c % R without every node peer's head: chunk
    2 lands in slot 0 while a node peer may still forward chunk 0 out of it. Every race
    is on the RDMA ring's slot 0 (x, scales, ids, weights: the counts travel once per call, in
    the meta); checker = brute force
    = execution."""
    for world in SHAPES[:2]:
        schedule = parse_file(NO_HEAD, world)
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert found and found == oracle_keys(schedule, world), (world, found)
        assert {k[2] for k in found} <= {f"{b}_rail_0" for b in ("x", "s", "ids", "w")}, \
            found
    assert disagreements(parse_file(NO_HEAD, SHAPES[0]), SHAPES[:1]) == []


def without_channel(text: str, channel: str, loops: tuple[str, ...]) -> str:
    """``text`` less every step on ``channel`` and the loops named (their open/drain, and
    the loops that hold only such steps: the combine's per-source head signals)."""
    kept: list[str] = []
    skip = -1
    for line in text.splitlines(keepends=True):
        indent = len(line) - len(line.lstrip())
        if skip >= 0 and (not line.strip() or indent > skip):
            continue
        skip = -1
        if any(line.lstrip().startswith(f"- {name}:") for name in loops):
            skip = indent
        elif f"channel: {channel}" not in line:
            kept.append(line)
    return "".join(kept)


@pytest.mark.parametrize(("channel", "loops", "rdma", "nvl", "ring"), [
    ("nvl_head", ("nvl_open", "nvl_drain", "nvl_frees", "last_nvl_frees"), 2, 1,
     ("x_recv", "s_recv", "ids_recv", "w_recv")),
    ("back_head", ("rail_open", "rail_drain", "back_frees", "last_back_frees"), 1, 2,
     ("z_back",))],
    ids=["dispatch_nvl_head_v1", "combine_back_head_r1"])
def test_deepep_normal_second_hop_credits_matter_at_one_slot(
        tmp_path: Path, channel: str, loops: tuple[str, ...], rdma: int, nvl: int,
        ring: tuple[str, ...]) -> None:
    """Only the first hop's ring (the dispatch's RDMA, the combine's NVLink) runs ahead in
    this program order; the second hop's put and read of a chunk fall in one loop
    iteration, so its credits (nvl_head, back_head) guard a slot only at a ring of one:
    without them the next chunk's put lands in slot 0 while the receiver still reads it.
    Refused there with a race on that ring's slot 0; checker = brute force."""
    path = ring_slots(tmp_path, rdma, nvl)
    path.write_text(without_channel(path.read_text(), channel, loops))
    assert f"channel: {channel}" not in path.read_text()
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code != 0 and "race on" in result.output, result.output
    schedule = parse_file(path, SHAPES[0])
    found = {f.key for f in hb.check(schedule, [SHAPES[0]], hints=False).findings}
    assert found and found == oracle_keys(schedule, SHAPES[0]), found
    assert {k[2] for k in found} <= {f"{b}_0" for b in ring}, found


@pytest.mark.e2e
@pytest.mark.parametrize(("rdma", "nvl", "backend"), [
    (1, 1, "host"), (3, 3, "host"), (1, 2, {"node": "torch", "gpu": "host"})],
    ids=["r1v1-host", "r3v3-host", "r1v2-node_torch"])
def test_deepep_normal_rings_match_float64(tmp_path: Path, rdma: int, nvl: int,
                                           backend: Any) -> None:
    """One slot per ring (every chunk after the first waits for the head), a slot per
    chunk, and the rail on gloo with the NVLink hops on host shared memory: every
    output matches float64 at 2x2, the fp8 tokens and ids bit for bit."""
    report = run_schedule(RunConfig(schedule=str(ring_slots(tmp_path, rdma, nvl)),
                                    world=MeshWorld((2, 2)), backend=backend, calls=3, seed=3))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert report.outputs["out_2"].compared == 3 * 4, text


def test_zero_and_full_counts_in_a_team_on_the_kernel(tmp_path: Path) -> None:
    """2x2 over gpu, two payloads (bf16 rows, i32 ids): member 0 sends nothing to member
    0 and a full block (capacity 4) to member 1, member 1 the reverse; each receiver gets
    exactly those rows of each payload, bit for bit, and the counts 4 and 0."""
    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.local import LocalGroup

    path = tmp_path / "rteam.yaml"
    path.write_text(head().replace("src: x, dst: y", "src: [x, ids], dst: [y, idr]")
                    .replace("  n:  {shape: [G]",
                             "  ids: {shape: [G, C, 2], dtype: i32}\n"
                             "  idr: {shape: [G, C, 2], dtype: i32, symmetric: true}\n"
                             "  n:  {shape: [G]"))
    _, module, _, _ = compile_to(str(path), tmp_path, MeshWorld((2, 2)))  # type: ignore[arg-type]

    def rank_main(rank: Any) -> Any:
        inst = load_module_class(module, "rteam")(rank, sizes={"N": 2, "G": 2, "C": 4},
                                                  device="cpu", backend="local", timeout_s=20)
        g = torch.Generator().manual_seed(rank.rank)
        x = torch.randn(2, 4, 8, generator=g).bfloat16()
        ids = torch.randint(-2**31, 2**31 - 1, (2, 4, 2), generator=g, dtype=torch.int32)
        member = rank.rank % 2
        counts = torch.tensor([0, 4] if member == 0 else [4, 0], dtype=torch.int32)
        try:
            y, idr, m = inst.move(x, ids, counts)
            return x, ids, y.clone(), idr.clone(), m.clone()
        finally:
            inst.close()

    got = LocalGroup(4, "cpu", timeout_s=60).run(rank_main)
    for node in range(2):
        a, b = got[2 * node], got[2 * node + 1]  # members 0 and 1 of one node's team
        for me, other, j in ((a, b, 0), (b, a, 1)):
            _, _, y, idr, m = me
            x_o, ids_o = other[0], other[1]
            p = 1 - j  # the other member's index: it sent me its full block j
            assert m[p] == 4 and m[j] == 0, m
            assert torch.equal(y[p], x_o[j]) and torch.equal(idr[p], ids_o[j])
