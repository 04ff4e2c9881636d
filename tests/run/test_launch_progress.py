"""The launcher tells a slow run from a hang by the ranks' progress (issue 21 item 6; the
fixed deadline of 60 + 0.6 x calls x W s killed correct W = 3 host runs on a loaded machine
as 'hung')."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from dcpc.harness.launch import launch, progress


def slow_but_moving(rank: int, world: int, steps: int, pause: float) -> int:
    for i in range(steps):
        progress(f"step {i}")
        time.sleep(pause)
    return rank


def stuck_after(rank: int, world: int, steps: int, pause: float) -> int:
    for i in range(steps):
        progress(f"step {i}")
        time.sleep(pause)
    time.sleep(3600)  # never says anything new again
    return rank


def waits_on_rank0(rank: int, world: int, marker: str) -> int:
    """Rank 0 works 7 s saying something new each step, then ends; rank 1 says its first
    words and waits silently for rank 0's end, then works 1.5 s."""
    progress("call 0")
    if rank == 0:
        for i in range(70):
            progress(f"step {i}")
            time.sleep(0.1)
        Path(marker).touch()
        return rank
    while not os.path.exists(marker):  # silent: no new words while it waits
        time.sleep(0.05)
    time.sleep(1.5)  # its own work, under the stall bound from rank 0's end
    return rank


def test_a_rank_that_waited_silently_on_a_peer_that_just_ended_is_not_hung(
        tmp_path: Path) -> None:
    """Rank 0's end is progress: rank 1, whose last words were 7 s old when rank 0
    reported, was killed as hung at the next look."""
    result = launch("tests.run.test_launch_progress:waits_on_rank0", 2,
                    {"marker": str(tmp_path / "rank0-done")}, timeout_s=600, stall_s=3)
    assert result.ok, result.summary()
    assert result.values() == [0, 1]


def test_a_run_still_progressing_at_its_deadline_is_a_timeout_not_a_hang() -> None:
    result = launch("tests.run.test_launch_progress:slow_but_moving", 2,
                    {"steps": 400, "pause": 0.25}, timeout_s=20, stall_s=15)
    assert [o.status for o in result.outcomes] == ["timeout", "timeout"], result.summary()
    assert re.match(r"timed out after \d+\.\d s \(still progressing\); killed while in "
                    r"step \d+ \(not a hang", result.outcomes[0].error), result.outcomes[0].error
    assert "while in step" in result.outcomes[0].error


def test_a_slow_run_finishes_when_every_step_is_shorter_than_the_stall_bound() -> None:
    result = launch("tests.run.test_launch_progress:slow_but_moving", 2,
                    {"steps": 12, "pause": 0.5}, timeout_s=120, stall_s=10)
    assert result.ok, result.summary()
    assert result.values() == [0, 1]


def test_ranks_with_nothing_new_for_the_stall_bound_are_hung_long_before_the_deadline() -> None:
    start = time.monotonic()
    result = launch("tests.run.test_launch_progress:stuck_after", 2,
                    {"steps": 2, "pause": 0.1}, timeout_s=600, stall_s=8)
    assert [o.status for o in result.outcomes] == ["hung", "hung"], result.summary()
    assert "nothing new for" in result.outcomes[1].error
    assert "while in step 1" in result.outcomes[1].error
    assert time.monotonic() - start < 300  # the stall bound, not the 600 s deadline
