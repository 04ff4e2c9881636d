"""A rank that dies or never arrives makes the others fail in bounded time, by name.

Also: epochs started just below the int32 limit keep working across the wrap.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dcpc.harness.run import RunConfig, format_report, run_schedule

SCHEDULES = Path(__file__).resolve().parents[2] / "schedules"
KIMI = str(SCHEDULES / "kimi_k3_dcp.yaml")
WAIT_S = 3.0  # seconds a wait lasts (the modules' timeout_s)
LAUNCH_S = 150  # the launch's bound on a rank (run_schedule's timeout_s)

pytestmark = pytest.mark.liveness

TIMEOUT = re.compile(
    r"DcpcTimeoutError: step '(?P<step>\w+)': rank (?P<rank>\d+) timed out waiting for "
    r"peer (?P<peer>\d+) to signal epoch (?P<epoch>-?\d+)")
# a dead peer is named at once, not after the wait (issue 31: the host watches its peers)
DIED = re.compile(
    r"DcpcPeerFailedError: step '(?P<step>\w+)': rank (?P<rank>\d+) stopped waiting for "
    r"peer (?P<peer>\d+) \(epoch (?P<epoch>-?\d+)\): peer \d+ died \(its process is gone")


@pytest.mark.parametrize("kind,status,grace,error", [("exit", "died", 45, DIED),
                                                     ("sleep", "hung", 10, TIMEOUT)])
def test_missing_peer_times_out_naming_step_peer_and_epoch(kind: str, status: str,
                                                           grace: float,
                                                           error: re.Pattern) -> None:
    fault = {"rank": 1, "call": 3, "step": "out_exchange", "kind": kind}
    report = run_schedule(RunConfig(schedule=KIMI, world=3, backend="host", calls=6, seed=3,
                                    wait_timeout_s=WAIT_S, fault=fault, timeout_s=LAUNCH_S,
                                    grace_s=grace))
    text = format_report(report)
    statuses = [o.status for o in report.launch.outcomes]
    assert statuses == ["error", status, "error"], text
    for rank in (0, 2):
        found = error.search(report.launch.outcomes[rank].error)
        assert found, report.launch.outcomes[rank].error
        assert found["step"] == "out_exchange" and int(found["peer"]) == 1
        assert int(found["rank"]) == rank
        # call 3 runs on slot 0 (calls alternate 1, 0, 1, 0): its second use of the slot
        assert int(found["epoch"]) == 2, found.group(0)
        # bounded by its own wait, not by the launch's: it reported (its status is "error",
        # not "timeout") before the launch's bound; no wall-clock bound here (a loaded
        # machine stretches process start and compile, not the protocol)
        reported = report.launch.outcomes[rank].reported_s
        assert reported is not None and reported < LAUNCH_S, text
        print(f"rank {rank} gave up {reported:.1f} s after launch")


@pytest.mark.parametrize("backend", ["host", "torch"])
def test_epochs_wrap_past_int32_max(backend: str) -> None:
    start = 2**31 - 5
    report = run_schedule(RunConfig(schedule=KIMI, world=2, backend=backend, calls=16, seed=9,
                                    epoch_start=start))
    text = format_report(report)
    assert report.ok, text + "\n".join(o.traceback for o in report.launch.outcomes)
    if backend == "host":  # the signal bank's counters went past 2**31 - 1 and wrapped
        for rank in report.ranks:
            assert rank.epochs and min(rank.epochs) < 0 < max(rank.epochs), rank.epochs
