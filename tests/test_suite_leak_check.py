"""The suite's own end-of-session leak check (tests/conftest.py), run on a session of
its own: a leftover in the session's own temporary directory fails it at once, with no
settle wait (that wait is for /dev/shm, where other processes write too)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")
HANG_GUARD_S = 600  # a guard, not a claim: the inner session ends in seconds

LEAKING_TEST = '''
import os
import tempfile


def test_leaves_a_folder():
    os.mkdir(os.path.join(tempfile.gettempdir(), "dcpc-run-leftover"))
'''


def test_a_leftover_in_the_own_temporary_directory_fails_before_any_settle_wait(
        tmp_path: Path) -> None:
    """The inner session's settle wait is an hour (DCPC_TEST_SETTLE_S): it ends, failed
    for the folder it leaves, long before that, so the folder is reported without the
    wait (which waited the whole hour on a leftover before: it stays)."""
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_leak.py").write_text(LEAKING_TEST)
    # a plain session of its own: its own temporary folder, none of the outer session's
    # pytest options or xdist worker settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")
           and k not in ("DCPC_TESTS_TMPDIR", "DCPC_TESTS_TMPDIR_OWNER")}
    env["DCPC_TEST_SETTLE_S"] = "3600"
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "test_leak.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=HANG_GUARD_S)
    assert inner.returncode == pytest.ExitCode.TESTS_FAILED, inner.stdout
    assert any("FAILED: folders left in" in line and "dcpc-run-leftover" in line
               for line in inner.stdout.splitlines()), inner.stdout
    assert "1 passed" in inner.stdout, inner.stdout  # the leak fails it, not the test
