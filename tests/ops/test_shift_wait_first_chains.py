"""Waits written before their puts of several chains, or with their puts in another
order (issue 33's gaps (a), (b), (c)): the span is proved by running it rank by rank
(dcpc.ops.shift ``span_run``), and refused only where a rank blocks forever, with the
cycle of waits named; schedules/ops/shift_wait_first_{two_chains,two_chains_axis,
reversed}.yaml are proved, agree with the brute force and the execution oracle, and run
against float64 on every CPU backend; their twins that hang are refused, and hang in
the exact models (or, the torch-only ones, in a torch run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.exec_oracle_agree import channel_names, checker_covers
from support.hb_oracle import oracle_keys
from support.schedules import run_clean

from dcpc.check import structural
from dcpc.check.oracle import explore
from dcpc.codegen.lower import lower
from dcpc.harness.run import RunConfig, run_schedule
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_text

OPS = Path(__file__).resolve().parents[2] / "schedules" / "ops"
TWO = OPS / "shift_wait_first_two_chains.yaml"
AXIS = OPS / "shift_wait_first_two_chains_axis.yaml"
REVERSED = OPS / "shift_wait_first_reversed.yaml"
FILES = {TWO: [2, 3, 4], REVERSED: [2, 3, 4], AXIS: [MeshWorld((2, 2)), MeshWorld((2, 3))]}
TESTS = Path(__file__).resolve().parents[2] / "tests"
# the reversed puts along gpu (a team group's early receive; found by review), and waits
# whose sources differ at some ranks (the early receive's run-time source filter)
REVERSED_AXIS = TESTS / "mesh_backends" / "wait_first_reversed_axis.yaml"
SOURCES = TESTS / "shift" / "wait_first_sources.yaml"
MORE = {REVERSED_AXIS: [MeshWorld((2, 2)), MeshWorld((2, 3))], SOURCES: [4]}


def _errors(text: str, world: int) -> list:
    schedule = parse_text(text, "s.yaml", world=world)
    return [d for d in structural.check(schedule, [world]) if d.severity == "error"]


def _swap(text: str, a: str, b: str) -> str:
    """``text`` with the steps named ``a`` and ``b`` swapped."""
    lines = text.splitlines(keepends=True)
    i, j = (next(k for k, ln in enumerate(lines) if f"- {n}:" in ln) for n in (a, b))
    lines[i], lines[j] = lines[j], lines[i]
    return "".join(lines)


def _line(text: str, name: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if f"- {name}:" in ln)


@pytest.mark.parametrize("path,world", [(p, w) for p, ws in {**FILES, **MORE}.items()
                                          for w in ws], ids=str)
def test_the_files_are_proved_by_the_checker_and_both_exact_models(path: Path,
                                                                   world: int) -> None:
    found, exact = checker_covers(path.read_text(), world)
    assert found == exact == set(), (path.name, world)


@pytest.mark.parametrize("world", [3, 4])
def test_a_skip_chain_backwards_deadlocks_with_the_cycle_named(world: int) -> None:
    """The skip connection from r + 2 instead of r - 2: rank 0 waits for rank 2's skip,
    rank 2 for rank 1's activations, rank 1 for rank 0's: a real hang, found by the
    brute force and the execution oracle too."""
    text = TWO.read_text().replace("offset: 2, wrap: false", "offset: -2, wrap: false")
    (refused,) = [d for d in _errors(text, world) if d.code == "wait-first-span"]
    assert refused.mark.line == _line(text, "receive")
    assert (f"run rank by rank at W={world}, hangs: rank 0 waits at 'receive_s' for rank "
            "2's 'send_s'; rank 2 waits at 'receive' for rank 1's 'send'; rank 1 waits at "
            "'receive' for rank 0's 'send' (the cycle of waits 0 -> 2 -> 1 -> 0)"
            ) in refused.message
    schedule = parse_text(text, world=world)
    assert any(k[0] == "deadlock" for k in oracle_keys(schedule, world))
    assert explore(lower(schedule, [world]), world, channels=channel_names(schedule)).hung


def test_the_skip_put_first_hangs_only_where_a_put_blocks_and_is_refused() -> None:
    """Skip first, then activations: the kernels' puts never block (the exact models
    find nothing), but on torch rank 0's put to rank 2 waits for rank 2's second
    receive while rank 2 waits for rank 1, which waits for rank 0's second put."""
    text = _swap(TWO.read_text(), "send", "send_s")
    (refused,) = [d for d in _errors(text, 3) if d.code == "wait-first-span"]
    assert "where a put blocks until its receiver posts the receive (the torch" in \
        refused.message
    assert ("rank 0's put 'send_s' waits for rank 2 to post its receive; rank 2 waits at "
            "'receive' for rank 1's 'send'; rank 1 waits at 'receive' for rank 0's 'send' "
            "(the cycle of waits 0 -> 2 -> 1 -> 0)") in refused.message
    schedule = parse_text(text, world=3)
    assert not any(k[0] == "deadlock" for k in oracle_keys(schedule, 3))


def test_the_axis_files_twin_with_the_perm_put_first_is_refused() -> None:
    """The line and the perm run on two groups (the gpu team's, the mesh's): the perm's
    put first blocks gpu 0 until gpu 1 posts its receive, which it does only after the
    line's (a torch run of it timed out: issue 33's notes); the kernels never block."""
    text = _swap(AXIS.read_text(), "send", "send_p")
    world = MeshWorld((2, 2))
    (refused,) = [d for d in _errors(text, world) if d.code == "wait-first-span"]
    assert ("rank 0's put 'send_p' waits for rank 1 to post its receive; rank 1 waits at "
            "'receive' for rank 0's 'send' (the cycle of waits 0 -> 1 -> 0)") in \
        refused.message
    schedule = parse_text(text, world=world)
    assert not any(k[0] == "deadlock" for k in oracle_keys(schedule, world))


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 3])
def test_without_the_early_receive_torch_hands_wait_a_the_data_of_put_b(world: int) -> None:
    """The reversed file on torch with the early receive patched out of its module
    (name=None: each wait receives its own next message): gloo matches the messages
    between two ranks in order, so recv_a gets aux and recv_b act: mismatches."""
    report = run_schedule(RunConfig(
        schedule=str(REVERSED), world=world, backend="torch", calls=2, seed=5,
        module_patch=(('name="receive_a"', "name=None"), ('name="receive_b"', "name=None"))))
    assert report.launch.ok and report.mismatches > 0


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "local"])
@pytest.mark.parametrize("path,world", [(p, w) for p, ws in FILES.items() for w in ws],
                         ids=str)
def test_dcpc_run_matches_float64(path: Path, world: int, backend: str) -> None:
    """Every backend but host (tests/ops/test_op_schedules.py runs host at the files'
    run worlds); torch receives the reversed file's second message at its first wait."""
    run_clean(schedule=str(path), world=world, backend=backend, calls=3, seed=5)


@pytest.mark.e2e
@pytest.mark.parametrize("path,world,backend,receivers", [
    (REVERSED_AXIS, MeshWorld((2, 3)), "torch", 4),
    (REVERSED_AXIS, MeshWorld((2, 3)), {"node": "host", "gpu": "torch"}, 4),
    (REVERSED_AXIS, MeshWorld((2, 2)), "host", 2),
    (SOURCES, 4, "torch", 2), (SOURCES, 4, "local", 2), (SOURCES, 4, "host", 2)], ids=str)
def test_the_test_files_match_float64(path: Path, world: int, backend: str,
                                      receivers: int) -> None:
    """The reversed puts along gpu: the early receive on each node's gpu team group (the
    mesh's backends mixed too: gpu on gloo, node on host). The sources file: at rank 2
    both waits' sources are rank 0 (received early), at rank 3 they differ (not: with the
    filter removed from collectives.shift this run hangs, rank 2 in send_b). Each
    receive buffer compared on every rank that receives, in every call."""
    report, text = run_clean(schedule=str(path), world=world, backend=backend, calls=3,
                             seed=5)
    for name in ("recv_a", "recv_b"):
        assert report.outputs[name].compared == 3 * receivers, (name, text)
