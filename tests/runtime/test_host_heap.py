"""HostHeap on its own: a small Triton kernel pushes into peers and signals them."""

from __future__ import annotations

import os

import pytest

from dcpc.harness.launch import launch
from dcpc.runtime.host import remove_orphan_segments

pytestmark = pytest.mark.host


@pytest.mark.parametrize("world", [2, 3, 4])
def test_push_and_signal_between_processes(world: int) -> None:
    result = launch("dcpc.harness.probe:heap_probe", world, {"iters": 8, "seed": world},
                    timeout_s=120)
    assert result.ok, result.summary() + "\n" + "\n".join(o.traceback for o in result.outcomes)
    for rank, report in enumerate(result.values()):
        assert report["mismatches"] == 0, (rank, report)
        assert report["segments_left"] == [], "own segment still linked after allocate"
        assert report["poison_nan"], "poison=True must read as NaN in float views"
        assert report["first_bytes"] == [255] * 4
        assert report["ptr_is_local"], "peer_ptrs[rank] must be this rank's instance"
        assert report["aligned"], "buffers must start 256-B aligned in every process"
        assert report["sig_nbytes"] == world * 3 * 4 + 3, "local view has the asked size"
        assert report["epochs"] == [8, 8, 8]
        assert report["closed"]


def test_crash_after_allocate_leaves_nothing_in_dev_shm() -> None:
    before = {f for f in os.listdir("/dev/shm") if f.startswith("dcpc-")}
    result = launch("dcpc.harness.probe:crash_after_allocate", 2, timeout_s=60, grace_s=5)
    assert [o.status for o in result.outcomes] == ["died", "died"]
    assert [o.exitcode for o in result.outcomes] == [3, 3]
    after = {f for f in os.listdir("/dev/shm") if f.startswith("dcpc-")}
    # new names whose creator is gone: the dead ranks' (another test's live process may
    # hold segments of its own meanwhile: the suite runs test files in parallel)
    assert not (after - before) & set(remove_orphan_segments()), sorted(after - before)


def test_heap_needs_a_process_group() -> None:
    import torch.distributed as dist

    from dcpc.runtime.host import HostHeap

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="torch.distributed"):
        HostHeap(None)
