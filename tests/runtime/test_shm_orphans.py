"""Issue 13 item 9: a rank killed during construction leaves its /dev/shm segment;
its name says whose it was, so the next run (or ``dcpc run``) removes it, and only it."""

from __future__ import annotations

import os

import pytest

from dcpc.harness.launch import launch
from dcpc.runtime.host import SHM_DIR, remove_orphan_segments, segment_prefix

pytestmark = pytest.mark.host


def test_segment_names_carry_the_creator() -> None:
    mine = segment_prefix()
    assert mine.startswith("dcpc-") and f"-{os.getpid()}-" in mine
    assert mine == segment_prefix(os.getpid())


def test_a_rank_killed_during_allocate_leaves_an_orphan_the_next_run_removes() -> None:
    result = launch("dcpc.harness.probe:killed_during_allocate", 2, timeout_s=120, grace_s=10)
    statuses = [o.status for o in result.outcomes]
    assert statuses[1] == "ok", result.summary()
    assert statuses[0] == "died" and result.outcomes[0].exitcode == -9, result.summary()
    (orphan,) = result.outcomes[1].value
    assert os.path.exists(os.path.join(SHM_DIR, orphan)), "the killed rank left no segment"
    # a live process's segment of the same format is never touched
    live = os.path.join(SHM_DIR, f"{segment_prefix()}{'0' * 12}")
    with open(live, "wb"):
        pass
    try:
        again = launch("dcpc.harness.probe:heap_probe", 2, {"iters": 1}, timeout_s=120)
        assert again.ok, again.summary()
        assert not os.path.exists(os.path.join(SHM_DIR, orphan)), "HostHeap() left the orphan"
        assert os.path.exists(live), "a live process's segment was removed"
        assert os.path.basename(live) not in remove_orphan_segments()
        assert os.path.exists(live)
    finally:
        os.unlink(live)
