"""The multi-process launcher never hangs and says which rank did what."""

from __future__ import annotations

import time

import pytest

from dcpc.harness.launch import launch

pytestmark = pytest.mark.host


def test_a_rank_that_never_returns_is_reported_hung_and_killed() -> None:
    start = time.monotonic()
    result = launch("dcpc.harness.probe:sleep_on_rank", 3, {"sleeper": 2}, timeout_s=15)
    assert time.monotonic() - start < 40
    assert [o.status for o in result.outcomes] == ["ok", "ok", "hung"]
    assert result.values()[:2] == [0, 1]
    assert result.outcomes[2].exitcode is not None, "the hung rank must be killed"


def test_a_failing_rank_reports_its_exception() -> None:
    result = launch("dcpc.harness.probe:fail_on_rank", 2, {"failing": 1}, timeout_s=60)
    assert [o.status for o in result.outcomes] == ["ok", "error"]
    assert "ValueError: rank 1 fails on purpose" in result.outcomes[1].error
    assert "fail_on_rank" in result.outcomes[1].traceback


def test_ranks_start_from_the_warm_fork_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank forked from the fork server finds what each host rank did in every run
    already done (dcpc.harness.forkwarm): the imports, lower.base_class_names filled, every
    jit function of the device library rewritten by the interpreter (30 or more). The
    fork server passes over a preload that raises ImportError in silence: a broken
    forkwarm would make every rank of every run cold again, and only slower."""
    monkeypatch.delenv("DCPC_LAUNCH", raising=False)  # the fork server, not spawn
    result = launch("support.warm:state", 2, timeout_s=120)
    assert result.ok, result.summary()
    for value in result.values():
        jit, rewritten = value.pop("device_rewrites")
        assert jit >= 30 and rewritten == jit, value
        assert value == {"forkwarm": True, "base_class_names": 1, "imported": [
            "dcpc.codegen.lower", "dcpc.runtime.host", "dcpc.runtime.loading",
            "torch.utils.serialization", "triton.compiler.code_generator"]}, value
