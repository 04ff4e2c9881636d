"""Issue 13 item 9: a rank killed during construction leaves its /dev/shm segment;
its name says whose it was, so the next run (or ``dcpc run``) removes it, and only it.

The killing test keeps its segments in a folder of its own (DCPC_SHM_DIR): in /dev/shm
a HostHeap of another test file running beside it (pytest-xdist) would remove the
orphan first, as it should (the loaded CI of 4b70b4b failed so)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from dcpc.harness.launch import launch
from dcpc.runtime.host import SHM_DIR, HostHeap, remove_orphan_segments, segment_prefix

pytestmark = pytest.mark.host


def test_segment_names_carry_the_creator() -> None:
    mine = segment_prefix()
    assert mine.startswith("dcpc-") and f"-{os.getpid()}-" in mine
    assert mine == segment_prefix(os.getpid())


@pytest.fixture
def private_shm(monkeypatch: pytest.MonkeyPatch):
    """A tmpfs folder no other test's HostHeap sweeps; the children inherit the setting."""
    base = SHM_DIR if os.path.isdir(SHM_DIR) else None
    folder = tempfile.mkdtemp(prefix="dcpctest-", dir=base)
    monkeypatch.setenv("DCPC_SHM_DIR", folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_rank_killed_during_allocate_leaves_an_orphan_the_next_run_removes(
    private_shm: str,
) -> None:
    result = launch("dcpc.harness.probe:killed_during_allocate", 2, timeout_s=120, grace_s=10)
    statuses = [o.status for o in result.outcomes]
    assert statuses[1] == "ok", result.summary()
    assert statuses[0] == "died" and result.outcomes[0].exitcode == -9, result.summary()
    (orphan,) = result.outcomes[1].value
    assert os.path.exists(os.path.join(private_shm, orphan)), "the killed rank left no segment"
    assert not any(n == orphan for n in os.listdir(SHM_DIR)), "created outside DCPC_SHM_DIR"
    # a live process's segment of the same format is never touched
    live = os.path.join(private_shm, f"{segment_prefix()}{'0' * 12}")
    with open(live, "wb"):
        pass
    try:
        again = launch("dcpc.harness.probe:heap_probe", 2, {"iters": 1}, timeout_s=120)
        assert again.ok, again.summary()
        assert not os.path.exists(os.path.join(private_shm, orphan)), "HostHeap() left the orphan"
        assert os.path.exists(live), "a live process's segment was removed"
        assert os.path.basename(live) not in remove_orphan_segments()
        assert os.path.exists(live)
    finally:
        os.unlink(live)


def test_a_shm_dir_that_is_not_a_folder_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCPC_SHM_DIR", "/nonexistent/dcpc-shm")
    with pytest.raises(ValueError, match="'/nonexistent/dcpc-shm' .*not a folder"):
        HostHeap()
