"""Deadlines on the host that scale with measured progress, not fixed wall seconds.

A wait on CPU gives up on a peer after ``timeout_s``. On a loaded machine (more runnable
threads than cores) a healthy peer makes its progress more slowly, so a deadline in wall
seconds names healthy ranks as missing (issue 31: the suite beside two busy loops).
Two measures of the progress a thread of this machine makes:

- ``cpu_clock``: the CPU time of a thread. A wait that spins (the CPU backends' kernel
  waits) runs whenever the machine lets a busy thread run, as often as the peers it
  waits for: its CPU time is the deadline (dcpc.runtime.sync.Watchdog).
- ``cpu_share``: the share of a CPU a busy thread gets now, sampled by spinning briefly.
  A wait that blocks (a gloo receive, whose timeout is fixed when it starts) gets
  ``timeout_s / share`` wall seconds (``wall_timeout``): the same progress.

On an idle machine both are wall time. Stdlib only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

SAMPLE_S = 0.05  # how long cpu_share spins to measure


def kernel_clock(device_type: str) -> bool:
    """Whether a kernel's waits time themselves (the ``CLOCK`` constexpr: the GPU's
    global timer against ``timeout_ns``) on a device of this type; else (CPU, the Triton
    interpreter) the host's watchdog stops them (``sync.Watchdog``)."""
    return device_type == "cuda"
MIN_SHARE = 1 / 16  # a blocking wait is stretched at most 16 times


def _clock_id(thread_id: int | None) -> int | None:
    """The id of thread ``thread_id``'s CPU clock (default: the calling thread), probed
    once; None where the platform has no per-thread CPU clock (not Unix) or the thread
    has ended (its id may not read)."""
    try:
        clock = time.pthread_getcpuclockid(
            threading.get_ident() if thread_id is None else thread_id)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return None
    return clock


def thread_cpu_s(thread_id: int | None = None) -> float | None:
    """The CPU seconds thread ``thread_id`` (default: the calling thread) has used, read
    from any thread; None where the platform has no per-thread CPU clock (not Unix) or
    the thread has ended."""
    clock = _clock_id(thread_id)
    if clock is None:
        return None
    try:
        return time.clock_gettime(clock)
    except OSError:  # ended since the probe
        return None


def cpu_clock(thread_id: int | None = None) -> Callable[[], float]:
    """Seconds of CPU time of thread ``thread_id`` (default: the calling thread), readable
    from any thread; wall seconds where the platform has no per-thread CPU clock."""
    clock = _clock_id(thread_id)
    if clock is None:
        return time.monotonic
    return lambda: time.clock_gettime(clock)


def cpu_share(sample_s: float = SAMPLE_S) -> float:
    """The share of a CPU (MIN_SHARE..1) the calling thread gets while it spins for
    ``sample_s`` wall seconds: 1 on an idle machine, about cores / runnable threads on
    a loaded one (and less while other threads of this process hold the GIL)."""
    clock = cpu_clock()
    wall0, cpu0 = time.monotonic(), clock()
    while time.monotonic() - wall0 < sample_s:
        pass
    wall, cpu = time.monotonic() - wall0, clock() - cpu0
    return min(1.0, max(cpu / wall if wall > 0 else 1.0, MIN_SHARE))


def wall_timeout(timeout_s: float) -> float:
    """The wall seconds a blocking wait of ``timeout_s`` seconds of progress gets now."""
    return timeout_s / cpu_share()
