"""Waits bounded in seconds, reaching ``dcpc run`` (issue 13, item 8): the flag reaches
the modules, and a rank the launcher must kill is reported with what it was doing while
its survivor reports the timeout by step, peer and epoch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcpc.harness.run import RunConfig, format_report, run_schedule

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "schedules" / "kimi_k3_dcp.yaml")

pytestmark = pytest.mark.liveness


def test_dcpc_run_wait_timeout_reaches_the_module() -> None:
    """A 1 ms wait cannot survive the interpreter: a timeout, reported with its bound."""
    done = subprocess.run(
        [sys.executable, "-m", "dcpc", "run", KIMI, "--world", "2", "--calls", "3",
         "--wait-timeout", "0.001", "--jitter-ms", "50"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    assert "timed out waiting for peer" in text and "(waited 0.001 s, timeout_s)" in text, text
    assert "Traceback" not in text, text


def test_a_stalled_rank_is_reported_with_what_it_was_doing() -> None:
    fault = {"rank": 1, "call": 1, "step": "out_exchange", "kind": "sleep"}
    report = run_schedule(RunConfig(schedule=KIMI, world=2, backend="host", calls=3, seed=2,
                                    wait_timeout_s=2.0, fault=fault, grace_s=5))
    text = format_report(report)
    survivor, stalled = report.launch.outcomes
    assert survivor.status == "error", text
    assert ("DcpcTimeoutError: step 'out_exchange': rank 0 timed out waiting for peer 1 to "
            "signal epoch 1 (waited 2 s, timeout_s)") in survivor.error, text
    assert stalled.status == "hung", text
    assert "killed while in call 1 (slot 0): method out_exchange()" in stalled.error, text
    assert survivor.reported_s is not None and survivor.reported_s < 60, text


def test_a_dead_peer_on_the_torch_backend_is_named_by_step_peer_and_epoch() -> None:
    fault = {"rank": 1, "call": 2, "step": "out_exchange", "kind": "exit"}
    report = run_schedule(RunConfig(schedule=KIMI, world=2, backend="torch", calls=4, seed=1,
                                    wait_timeout_s=3.0, fault=fault))
    text = format_report(report)
    survivor, dead = report.launch.outcomes
    assert dead.status == "died", text
    assert survivor.status == "error", text
    # gone at once (its connection closed) or silent until the bound: either way, named
    assert ("step 'out_exchange': rank 0 stopped waiting for peer 1 (epoch 2): peer 1 is "
            "unreachable" in survivor.error
            or "step 'out_exchange': rank 0 timed out waiting for peer 1 to signal epoch 2"
            in survivor.error), text
    assert survivor.reported_s is not None and survivor.reported_s < 60, text


def test_the_cpu_deadline_counts_the_waiting_threads_cpu_time() -> None:
    """Issue 31: a 2 s wait timed out healthy ranks on a loaded machine (their peer was
    descheduled, not stuck). The CPU watchdog's deadline is the waiting thread's CPU
    time: a thread that is not running (here: asleep, as a descheduled thread) does not
    use it up; a spinning one (a CPU wait) does, and is stopped."""
    import threading
    import time

    import torch

    from dcpc.runtime.sync import STOP_WORD, Watchdog

    errors = torch.zeros(8, dtype=torch.int32)
    dog = Watchdog(errors, timeout_s=0.3)
    seen: dict[str, object] = {}

    def waiter() -> None:
        dog.arm()
        time.sleep(1.5)  # five deadlines of wall time, no CPU time
        seen["asleep"] = int(errors[STOP_WORD])
        start = time.thread_time()
        while not errors[STOP_WORD] and time.thread_time() - start < 30:
            pass  # a wait spins
        seen["spun_s"] = time.thread_time() - start
        seen["stopped"] = int(errors[STOP_WORD])

    t = threading.Thread(target=waiter)
    t.start()
    t.join(120)
    dog.close()
    assert seen["asleep"] == 0, seen  # wall time alone never ends a wait
    assert seen["stopped"] == 1, seen  # the spinning thread's own CPU time does
    assert seen["spun_s"] < 30, seen


def test_a_closed_watchdog_s_thread_has_ended() -> None:
    """close() returns after the watchdog's thread ended. A daemon thread still ending
    when the interpreter finalises drops its tensors without the GIL and aborts the
    process ("terminate called without an active exception": test_signal_floor in CI
    beside two busy processes); an armed watchdog never closed is ended at exit."""
    import torch

    from dcpc.runtime.sync import Watchdog

    dogs = [Watchdog(torch.zeros(8, dtype=torch.int32), timeout_s=5.0) for _ in range(4)]
    dogs[1].arm()  # armed: its thread wakes on a timer
    for dog in dogs:
        dog.close()
        assert not dog._thread.is_alive()
    code = ("import torch\nfrom dcpc.runtime.sync import Watchdog\n"
            "dogs = [Watchdog(torch.zeros(8, dtype=torch.int32), 60.0) for _ in range(8)]\n"
            "for d in dogs: d.arm()\n"
            "import dcpc.runtime.sync as s\ns._close_watchdogs()\n"
            "print(sum(d._thread.is_alive() for d in dogs))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0", done.stdout
