"""Suite-wide fixtures: nothing the suite creates may be left in /dev/shm."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Every CPU test runs Triton's interpreter, which Triton reads when it is imported: set it
# before any test module (some import dcpc.runtime, hence triton, at collection) loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

SHM_DIR = "/dev/shm"
PREFIX = "dcpc-"  # dcpc.runtime.host.SEGMENT_PREFIX (not imported: keeps collection light)


def _segments() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left() -> Iterator[None]:
    before = _segments()
    yield
    left = sorted(_segments() - before)
    assert not left, f"segments left in {SHM_DIR} by the test suite: {left}"


def pytest_configure(config: pytest.Config) -> None:
    for marker in (
        "host: runs processes that share memory through dcpc.runtime.host",
        "e2e: runs a generated module end to end across processes",
        "liveness: dead or absent peers, epoch wrap-around",
    ):
        config.addinivalue_line("markers", marker)
