"""Suite-wide checks: nothing the suite creates may be left in /dev/shm or the temporary
directory."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import hypothesis
import pytest

# Every CPU test runs Triton's interpreter, which Triton reads when it is imported: set it
# before any test module (some import dcpc.runtime, hence triton, at collection) loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests draw the same examples on every run (a red CI is reproducible, and main
# does not turn red on a new draw): HYPOTHESIS_PROFILE=explore draws fresh ones, for a
# search by hand. Each test's own @settings (max_examples) still applies.
hypothesis.settings.register_profile("ci", derandomize=True, database=None)
hypothesis.settings.register_profile("explore", derandomize=False)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The session's temporary directory is a folder of its own (TMPDIR: read by tempfile here,
# in every xdist worker and in every process a test starts), made by the process that
# runs the session (a plain run, or xdist's controller) and removed when it ends: what is
# left in it was left by this session, not by another session's live run in the
# machine's /tmp.
TMP_ENV, TMP_OWNER_ENV = "DCPC_TESTS_TMPDIR", "DCPC_TESTS_TMPDIR_OWNER"
if TMP_ENV not in os.environ:
    os.environ[TMP_ENV] = tempfile.mkdtemp(prefix="pytest-dcpc-")
    os.environ[TMP_OWNER_ENV] = str(os.getpid())
os.environ["TMPDIR"] = os.environ[TMP_ENV]
tempfile.tempdir = None  # tempfile reads TMPDIR again

SHM_DIR = "/dev/shm"
PREFIX = "dcpc-"  # dcpc.runtime.host.SEGMENT_PREFIX (not imported: keeps collection light)
# and the folders the product and benchmarks make in the temporary directory (dcpc-run-,
# dcpc-launch-, dcpc-trace-, dcpc-floor-, dcpc-new-ops-, dcpc-capture-warm-...)
WATCHED = {"segments": SHM_DIR, "folders": os.environ[TMP_ENV]}
_BEFORE = pytest.StashKey[dict[str, set[str]]]()
SHARED = {"segments"}  # watched places other processes write to as well
# How long a new segment may take to go before it is a leftover: 120 s, or
# DCPC_TEST_SETTLE_S seconds (tests/test_suite_leak_check.py sets it to an hour for a
# session of its own, which must then end without the wait: nothing in /dev/shm)
SETTLE_S = float(os.environ.get("DCPC_TEST_SETTLE_S", "120"))


def _entries(folder: str) -> set[str]:
    try:
        return {name for name in os.listdir(folder) if name.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # a plain run, or xdist's controller
        session.config.stash[_BEFORE] = {k: _entries(f) for k, f in WATCHED.items()}


def _still_there(found: dict[str, set[str]]) -> dict[str, set[str]]:
    """What of ``found`` (in SHARED places) is still there after SETTLE_S seconds: another
    process on the machine (a second test session, a run by hand) makes and removes
    segments in /dev/shm too, and its live ones are not this session's leftovers; a
    leftover stays."""
    deadline = time.monotonic() + SETTLE_S
    while any(found.values()) and time.monotonic() < deadline:
        time.sleep(1.0)
        found = {what: names & _entries(WATCHED[what]) for what, names in found.items()}
    return found


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Checked once, after every test of every worker (the workers run test files at
    the same time: one worker's live segments are not another's leftovers). Only what
    appeared during the session counts: in the session's own temporary directory, where
    nothing else writes, at once; in SHARED places, what stays SETTLE_S."""
    if hasattr(session.config, "workerinput") or _BEFORE not in session.config.stash:
        return
    before = session.config.stash[_BEFORE]
    new = {what: _entries(folder) - before[what] for what, folder in WATCHED.items()}
    _report(session, {what: names for what, names in new.items() if what not in SHARED})
    _report(session, _still_there({what: new[what] for what in SHARED}))


def _report(session: pytest.Session, left: dict[str, set[str]]) -> None:
    """Fail the session for what ``left`` names, said at once (a wait may follow)."""
    for what, names in left.items():
        if not names:
            continue
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"FAILED: {what} left in {WATCHED[what]} by the test suite: "
                                f"{sorted(names)}", red=True)
            reporter.flush()
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's temporary directory goes with the process that made it, at its exit:
    after multiprocessing's own clean-up, whose folder (a fork server's, exit priority
    -100) is in it."""
    if os.environ.get(TMP_OWNER_ENV) == str(os.getpid()):
        from multiprocessing import util

        util.Finalize(None, shutil.rmtree, args=(os.environ[TMP_ENV],),
                      kwargs={"ignore_errors": True}, exitpriority=-101)


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `dcpc run` refused before any rank starts: starting one fails the test."""
    from dcpc.harness import launch, run

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "launch", started)
    monkeypatch.setattr(run, "launch", started)


@pytest.fixture(autouse=True)
def fresh_engine_workspace() -> Iterator[None]:
    """The vLLM adapters' workspace is decided once per process (a server's every call
    must find the same module), from the first vLLM config seen; tests set it per test
    (DCPC_MAX_NUM_TOKENS, a config): no test may inherit an earlier test's choice or
    config, whatever ran before it in this process. Nor the call ids (context variables
    of the thread that runs the tests) that an installed hook set when a test entered a
    forward or a layer: test_engines_call_ids expects none known (it failed after
    test_engines_install in one worker)."""
    _clear_workspace()
    yield
    _clear_workspace()


def _clear_workspace() -> None:
    vllm = sys.modules.get("dcpc.engines.vllm")
    if vllm is not None:
        vllm.forget_config()
    ids = sys.modules.get("dcpc.engines.call_ids")
    if ids is not None:
        ids._forward.set(None)
        ids._layer.set(None)


def pytest_configure(config: pytest.Config) -> None:
    for marker in (
        "host: runs processes that share memory through dcpc.runtime.host",
        "e2e: runs a generated module end to end across processes",
        "liveness: dead or absent peers, epoch wrap-around",
    ):
        config.addinivalue_line("markers", marker)
