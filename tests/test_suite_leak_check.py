"""The suite's own end-of-session leak check (tests/conftest.py), run on a session of
its own: a leftover in the session's own temporary directory fails it at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

LEAKING_TEST = '''
import os
import tempfile


def test_leaves_a_folder():
    os.mkdir(os.path.join(tempfile.gettempdir(), "dcpc-run-leftover"))
'''


def test_a_leftover_in_the_own_temporary_directory_fails_before_any_settle_wait(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    settle_s = request.config.pluginmanager.get_plugin(str(CONFTEST)).SETTLE_S
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_leak.py").write_text(LEAKING_TEST)
    env = {k: v for k, v in os.environ.items()
           if k not in ("DCPC_TESTS_TMPDIR", "DCPC_TESTS_TMPDIR_OWNER")}  # its own folder
    inner = subprocess.Popen(
        [sys.executable, "-u", "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", "test_leak.py"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    said: list[str] = []

    def read() -> None:
        assert inner.stdout is not None
        for line in inner.stdout:
            said.append(line)
            if "FAILED: folders left in" in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # a hang guard, not a measure: the report comes before any wait on /dev/shm
    reader.join(settle_s / 2)
    try:
        assert any("FAILED: folders left in" in line and "dcpc-run-leftover" in line
                   for line in said), "".join(said)
        assert inner.wait(settle_s * 2) == pytest.ExitCode.TESTS_FAILED, "".join(said)
    finally:
        inner.kill()
        inner.wait()
