"""What ``dcpc run`` (and the harness's ``RunConfig``) accepts, checked before any rank
starts. This module imports nothing of torch: the command line checks its options
before it looks for torch (``check_options``); ``check_compiled`` reads the compiled
module's own rules in the parent.

Issue 31: ``--calls 1e20`` built the whole event plan first (740 MB and 26 s per million
calls), ``--jitter-ms inf`` raised OverflowError in every rank and ``1e7`` was reported
as a module hang, ``--timeout 0/-5/nan`` were accepted, and a mesh axis in ``--sizes``,
``--wait-timeout`` or ``--backend`` that the module refuses was refused by every rank
after W processes started.
"""

from __future__ import annotations

import math
from typing import Any

# A run compares every output of every call with a float64 reference: 10,000 calls of
# the shipped schedules take hours on CPU, and their event plan (about 740 bytes per
# call and rank) stays below 10 MB per rank.
MAX_CALLS = 10_000
MAX_RUN_WORLD = 64  # W processes on one machine
# A random delay before/after a step stands for a slow rank; one of a second already
# reorders everything a run can reorder, and stays far below a wait's timeout (60 s).
MAX_JITTER_S = 1.0
MAX_RUN_TIMEOUT_S = 10**7  # the modules' own bound on a wait (dcpc.runtime.module)
DEFAULT_CALLS = 20  # calls per rank when none are asked, unless the slots need more


def default_calls(slots: int) -> int:
    """Calls run when ``--calls`` is not given: at least 2 x slots + 1, so that call c and
    call c + slots (the next user of c's slot) both run for every slot, and the calls
    0 .. 2 x slots - 1 the happens-before checker unrolls (dcpc.check.hb) all run."""
    return max(DEFAULT_CALLS, 2 * slots + 1)


class RunConfigError(ValueError):
    """An option ``dcpc run`` refuses before any rank starts (exit 2)."""


def _number(option: str, value: object, low: float, high: float, *,
            low_open: bool = False) -> None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (low < value if low_open else low <= value)
          and value <= high)
    if not ok:
        bound = f"above {low:g}" if low_open else f"in {low:g}..{high:g}"
        raise RunConfigError(f"{option} must be a finite number {bound}"
                             + (f" (at most {high:g})" if low_open else "") + f", got {value!r}")


def check_options(*, calls: object, jitter_s: object, jitter_p: object = 0.3,
                  timeout_s: object = None, wait_timeout_s: object = None) -> None:
    """The run's own options: calls (None: the schedule's default), delays, timeouts
    (``RunConfigError`` naming the option and its range)."""
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int)
                              or not 1 <= calls <= MAX_CALLS):
        raise RunConfigError(f"--calls must be an integer in 1..{MAX_CALLS}, got {calls!r}")
    _number("--jitter-ms", jitter_s if not isinstance(jitter_s, (int, float)) else
            jitter_s * 1000, 0, MAX_JITTER_S * 1000)
    _number("the chance of a delay (jitter_p)", jitter_p, 0, 1)
    if timeout_s is not None:
        _number("--timeout (seconds)", timeout_s, 0, MAX_RUN_TIMEOUT_S, low_open=True)
    if wait_timeout_s is not None:
        from dcpc.runtime.module import MAX_TIMEOUT_S

        _number("--wait-timeout (seconds)", wait_timeout_s, 1e-3, MAX_TIMEOUT_S)


def check_config(config: Any) -> None:
    """``check_options`` of a ``RunConfig``."""
    check_options(calls=config.calls, jitter_s=config.jitter_s, jitter_p=config.jitter_p,
                  timeout_s=config.timeout_s, wait_timeout_s=config.wait_timeout_s)


def check_compiled(config: Any, schedule_path: str, module_path: str, name: str) -> None:
    """What the compiled module's constructor would refuse in every rank, asked once in
    the parent: ``--backend``'s axes (the module's own rule, dcpc.runtime.axes.split)
    and ``--sizes`` for a mesh axis' size, which ``--world`` binds."""
    from dcpc.harness.synth import mesh_sizes
    from dcpc.harness.worker import load_module_class
    from dcpc.lang.parse import parse_file
    from dcpc.runtime import DcpcArgumentError
    from dcpc.runtime.axes import split

    cls = load_module_class(module_path, name).for_world(config.world)
    try:
        split(cls.__name__, config.backend, cls.MESH, cls.TEAMS, cls.SIGNALLING)
    except DcpcArgumentError as exc:
        raise RunConfigError(f"--backend: {exc}") from None
    axis_sizes = mesh_sizes(parse_file(schedule_path, world=config.world), config.world)
    for size, value in (config.sizes or {}).items():
        if size in axis_sizes and value != axis_sizes[size]:
            raise RunConfigError(
                f"--sizes: {size} sizes a mesh axis, which --world {config.world} binds to "
                f"{axis_sizes[size]}, not {value}; leave it out (or change --world)")
