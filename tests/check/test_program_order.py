"""The CPU interpreter takes a launch's programs in another order, and several programs
per launch show what one program per launch hides (dcpc.harness.interpret).

A GPU runs a launch's programs at once, in any order; Triton's interpreter runs them one
after another, program 0 first. A kernel whose tiles are not split over its programs (the
program offset gone) writes only some tiles: with one program per launch, the default of
`dcpc run` on CPU, every tile is that program's and the run passes; with three programs
in a shuffled order it fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from dcpc.harness.interpret import ORDERS, _position, program_order
from dcpc.harness.run import RunConfig, run_schedule

ROOT = Path(__file__).resolve().parents[2]
NO_OFFSET = (("tile = i * programs + pid", "tile = i * programs"),)


@triton.jit
def _turns(counter, order):
    """Each program takes the next turn number and writes it at its own index."""
    turn = tl.atomic_add(counter, 1)
    tl.store(order + tl.program_id(0), turn)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter")
@pytest.mark.parametrize("order", ORDERS)
def test_the_interpreter_takes_programs_in_the_order_asked(order: str) -> None:
    try:
        program_order(order, seed=3)
        counter = torch.zeros(1, dtype=torch.int32)
        turns = torch.full((7,), -1, dtype=torch.int32)
        _turns[(7,)](counter, turns)
        planned = [_position(x, 7) for x in range(7)]
    finally:
        program_order("natural")
    ran = sorted(range(7), key=lambda p: int(turns[p]))  # the programs in the order they ran
    assert ran == planned
    if order == "natural":
        assert ran == list(range(7))
    elif order == "reverse":
        assert ran == list(range(6, -1, -1))
    else:  # a permutation other than the natural order
        assert sorted(ran) == list(range(7)) and ran != list(range(7))


def test_an_unknown_order_is_refused() -> None:
    with pytest.raises(ValueError, match="choose from natural, reverse, shuffle"):
        program_order("random")


def _run(programs: int, patch: tuple = ()) -> object:
    return run_schedule(RunConfig(str(ROOT / "schedules/kimi_k3_dcp.yaml"), world=2, calls=3,
                                  programs=programs, program_order="shuffle",
                                  module_patch=patch, jitter_s=0.0))


def test_a_kernel_without_its_program_offset_fails_with_several_programs() -> None:
    blind = _run(1, NO_OFFSET)
    assert blind.ok, "one program per launch: every tile is program 0's (the blind spot)"
    caught = _run(3, NO_OFFSET)
    assert not caught.ok and caught.mismatches > 0
    assert any("= nan" in s.first_mismatch for s in caught.outputs.values())  # never written
    assert _run(3).ok  # the module as emitted, shuffled programs: clean
