"""``dcpc run`` (dcpc.demo.main): compile, run across processes, print, exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpc.demo import main

SCHEDULES = Path(__file__).resolve().parents[2] / "schedules"

pytestmark = pytest.mark.e2e


def test_demo_runs_kimi_and_reports_every_output(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([str(SCHEDULES / "kimi_k3_dcp.yaml"), "--world", "2", "--backend", "host",
                 "--calls", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    for word in ("kimi_k3_dcp", "backend host", "6 calls", "q_full", "o_recv", "lse_recv",
                 "out", "ms per call", "OK: every output matches (0 mismatches)"):
        assert word in out, (word, out)


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(SCHEDULES / "kimi_k3_dcp.yaml"), "--calls", "0"]) == 2
    assert main(["--backend", "nccl", str(SCHEDULES / "kimi_k3_dcp.yaml")]) == 2
    assert main([str(SCHEDULES / "kimi_k3_dcp.yaml"), "--world", "1"]) == 2
    assert "group sizes must lie in 2..1024" in capsys.readouterr().err


def test_demo_reports_a_schedule_that_does_not_compile(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("schedule: bad\nbuffers: {}\nsteps: []\n")
    assert main([str(bad), "--calls", "1"]) == 1
    assert "bad.yaml" in capsys.readouterr().err
