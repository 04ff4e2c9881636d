"""The ``local`` backend tells a slow run from a hang by its ranks' progress, as the
launcher does for processes (tests/run/test_launch_progress.py). Before, a LocalGroup's
only bound was its deadline: deepep_normal at 2x4 on one GPU, its ranks' threads busy
in the harness's host work (every call advancing), was reported as "did not finish (a
wait on a peer that never signalled ...)" at 150 s. Now ranks still saying something new
at the deadline are a timeout (``LocalRankTimeout``: not a hang), and ranks that all
stopped are a hang (``LocalRankHang``) once the stall bound passes, long before the
deadline."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.runtime.local import LocalGroup, LocalRankError, LocalRankHang, LocalRankTimeout

KIMI = str(Path(__file__).resolve().parents[2] / "schedules" / "kimi_k3_dcp.yaml")


def _steps(rank: Any, steps: int, pause: float) -> int:
    for i in range(steps):
        rank.progress(f"step {i}")
        time.sleep(pause)
    return rank.rank


def test_a_slow_run_that_keeps_progressing_finishes_past_the_stall_bound() -> None:
    """Each step is shorter than the stall bound, the run three times longer: done."""
    got = LocalGroup(2, "cpu", timeout_s=120).run(_steps, 12, 0.5, stall_s=2)
    assert got == [0, 1]


def test_ranks_still_progressing_at_the_deadline_are_a_timeout_not_a_hang() -> None:
    start = time.monotonic()
    with pytest.raises(LocalRankTimeout) as info:
        LocalGroup(2, "cpu", timeout_s=4).run(_steps, 400, 0.1, stall_s=30)
    text = str(info.value)
    assert "still progressing (not a hang" in text and "did not finish" not in text, text
    assert "rank 1 is at (step " in text, text
    assert time.monotonic() - start < 60, text
    time.sleep(0.5)  # the threads left behind run on (up to 400 x 0.1 s) and end by themselves


def test_ranks_that_all_stopped_are_hung_at_the_stall_bound_not_the_deadline() -> None:
    """A wait on a peer that never signals: nothing new from any rank, a hang named with
    each rank's last words and where it is, well before the 600 s deadline."""
    never = threading.Event()

    def body(rank: Any) -> None:
        rank.progress("call 0: method exchange()")
        never.wait(600)  # the peer's signal that never comes

    start = time.monotonic()
    try:
        with pytest.raises(LocalRankHang) as info:
            LocalGroup(2, "cpu", timeout_s=600).run(body, stall_s=3)
    finally:
        never.set()  # let the threads left behind end
    text = str(info.value)
    assert time.monotonic() - start < 120, text  # the stall bound, stretched on a busy machine
    assert "ranks [0, 1] did not finish within" in text and "nothing new from any rank" in text
    assert "stopped at the stall bound (3 s of progress, " in text, text
    assert "rank 0 is at (call 0: method exchange()):" in text and "in wait" in text, text


def test_a_rank_that_waited_silently_on_a_peer_that_just_ended_is_not_hung() -> None:
    """Rank 1 says its first words, then waits silently (a lock, as CallSims.get) while
    rank 0 works 3 s saying something new each step; rank 0 ends and rank 1 does its
    0.3 s of work: an end is progress, rank 1 is not stale (its own last words were 3 s
    old when rank 0 ended, and it was named hung)."""
    lock, held = threading.Lock(), threading.Event()

    def body(rank: Any) -> int:
        rank.progress("call 0")
        if rank.rank == 0:
            with lock:
                held.set()
                for i in range(30):
                    rank.progress(f"step {i}")
                    time.sleep(0.1)
            return 0
        held.wait()
        with lock:  # waits silently for rank 0
            time.sleep(0.3)  # then its own work, under the stall bound
        return 1

    assert LocalGroup(2, "cpu", timeout_s=600).run(body, stall_s=1) == [0, 1]


def test_a_failure_says_where_the_ranks_still_running_were_when_it_happened() -> None:
    """Rank 1 is in the group's barrier when rank 0 fails: the report names rank 1's last
    words, its thread's CPU time and its frames at that moment (after it, rank 1 leaves
    the broken barrier and ends: a look at the end would find nothing). A traced wait
    that timed out (test_shift_perm's pairs-4, once) was reported without the peer's
    place, so a stalled peer could not be told from a missed signal."""

    def body(rank: Any) -> None:
        if rank.rank == 1:
            rank.progress("call 0: method fill()")
            rank.group.barrier()  # broken by rank 0's failure: LocalRankError
            return
        while rank.group._barrier.n_waiting < 1:  # rank 1 is in the barrier
            time.sleep(0.01)
        raise RuntimeError("rank 0 gives up")

    with pytest.raises(LocalRankError) as info:
        LocalGroup(2, "cpu", timeout_s=600).run(body)
    text = str(info.value)
    assert text.startswith("rank 0 failed:") and "rank 0 gives up" in text, text
    where = text.split("when rank 0 failed, the ranks still running were at:\n", 1)[1]
    # its thread's CPU time where the platform has a per-thread clock (Unix)
    used = r" its thread used \d+\.\d\d s of CPU so far" if hasattr(
        time, "pthread_getcpuclockid") else ""
    assert re.match(rf"rank 1 is at \(call 0: method fill\(\)\):{used}\n", where), text
    assert "in barrier" in where, text


def test_without_a_stall_bound_the_deadline_still_names_a_hang() -> None:
    never = threading.Event()
    try:
        with pytest.raises(LocalRankHang, match=r"ranks \[0, 1\] did not finish within \d+ s, "
                           r"stopped at the deadline: "):
            LocalGroup(2, "cpu", timeout_s=2).run(lambda rank: never.wait(600))
    finally:
        never.set()


@pytest.mark.e2e
def test_dcpc_run_local_names_a_stopped_rank_hung_at_the_stall_bound() -> None:
    """``dcpc run --backend local``: rank 1 stops for good before a step (a peer that
    never signals); its peer's wait times out; the run is ``hung`` once nothing moved for
    the stall bound (wait + 30 s), not at the run's deadline (3600 s here, so that a
    loaded machine cannot make the deadline what stops it): the report says which."""
    fault = {"rank": 1, "call": 1, "step": "out_exchange", "kind": "sleep"}
    report = run_schedule(RunConfig(schedule=KIMI, world=2, backend="local", calls=3, seed=2,
                                    wait_timeout_s=2.0, timeout_s=3600, fault=fault))
    text = format_report(report)
    assert [o.status for o in report.launch.outcomes] == ["hung", "hung"], text
    error = report.launch.outcomes[1].error
    assert "LocalRankHang: ranks [1] did not finish" in error, text
    assert "rank 1 is at (call 1 (slot 0): method out_exchange())" in error, text
    assert "rank 0 failed" in error and "timed out waiting for peer 1" in error, text
    assert "stopped at the stall bound (32 s of progress, " in error, text


def test_local_ranks_share_one_simulation_per_call(tmp_path: Path, monkeypatch: Any) -> None:
    """The W threads of a local run simulate each call once between them (each rank made
    its own: W times the float64 reference, the host work that kept deepep_normal's
    ranks busy on one GPU), and every rank still compares every output with it."""
    from dcpc.harness import worker
    from dcpc.harness.run import compile_to

    used, module, _, _ = compile_to(KIMI, tmp_path, 3)
    made: list[int] = []
    real = worker.simulate_call

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(worker, "simulate_call", counted)
    args = RunConfig(schedule=KIMI, world=3, backend="local", calls=2).worker_args(used, module)
    reports = worker.run_local(0, 1, ranks=3, **args)
    assert len(made) == 2, len(made)
    assert [r.rank for r in reports] == [0, 1, 2]
    for r in reports:
        assert all(s.compared == 2 and s.mismatches == 0 for s in r.outputs.values()), r.outputs


def local_group_stops(rank: int, world: int, hang: bool) -> list[int]:
    """A launched process (the one process of a ``local`` run) whose LocalGroup of two
    ranks hangs (both stop: LocalRankHang) or is still progressing at its deadline
    (LocalRankTimeout)."""
    if hang:
        return LocalGroup(2, "cpu", timeout_s=600).run(
            lambda r: (r.progress("call 0"), time.sleep(3600)), stall_s=2)
    return LocalGroup(2, "cpu", timeout_s=3).run(_steps, 400, 0.1, stall_s=30)


@pytest.mark.parametrize(("hang", "status"), [(True, "hung"), (False, "timeout")])
def test_a_local_runs_status_is_its_exceptions_launch_status(hang: bool, status: str) -> None:
    """The launcher takes a process's status from the exception it raised
    (``launch_status``), and a ``local`` run's W ranks get it (dcpc.harness.run
    ``_per_rank``), not from the exception's text."""
    from dcpc.harness.launch import launch
    from dcpc.harness.run import _per_rank

    result = launch("tests.runtime.test_local_progress:local_group_stops", 1, {"hang": hang},
                    timeout_s=300)
    assert [o.status for o in result.outcomes] == [status], result.summary()
    ranks = _per_rank(result, 3)
    assert [o.status for o in ranks.outcomes] == [status] * 3, ranks.summary()
    assert ranks.outcomes[2].error == result.outcomes[0].error


RING = str(Path(__file__).resolve().parents[2] / "schedules" / "gallery" / "ring_attention.yaml")


@pytest.mark.parametrize("says", [True, False])
def test_a_shared_simulation_longer_than_the_stall_bound_is_progress_not_a_hang(
        says: bool) -> None:
    """The ranks of a local run share each call's float64 simulation (``CallSims``): one
    rank simulates, the others wait for it. The simulating rank says each step (``get``'s
    ``say``, as run_rank passes its own), so a simulation longer than the stall bound is
    progress: here each step's say also waits 0.2 s (ring_attention at W=8 has 49 steps:
    at least 9.8 s in all, whatever the machine), past a stall bound of 5 s, and the
    group finishes. Silent, the same simulation reads as a hang (a stall bound of 0.5 s:
    about 20 times that bound, which the detector stretches by the CPU share a loaded
    machine gives)."""
    from dcpc.harness import synth
    from dcpc.harness.worker import CallSims
    from dcpc.lang.parse import parse_file

    schedule = parse_file(RING, world=8)
    sims = CallSims(schedule, 8, synth.constructor_sizes(schedule, 8, {"T": 64, "N": 64}),
                    0, "nearest", users=2)

    def body(rank: Any) -> int:
        rank.progress("call 0")

        def say(what: str) -> None:
            time.sleep(0.2)  # a slow step
            if says:
                rank.progress(what)

        sims.get(0, say)
        return rank.rank

    start = time.monotonic()
    if says:
        assert LocalGroup(2, "cpu", timeout_s=600).run(body, stall_s=5) == [0, 1]
        assert time.monotonic() - start > 5  # longer than the stall bound: a real test
        return
    with pytest.raises(LocalRankHang, match=r"nothing new from any rank"):
        LocalGroup(2, "cpu", timeout_s=600).run(body, stall_s=0.5)
    while 0 not in sims.sims and time.monotonic() - start < 300:
        time.sleep(0.5)  # the thread left behind ends its simulation
