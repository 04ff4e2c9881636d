"""Issue 31: `dcpc run` refuses what a rank would refuse (or choke on) before any rank
starts: calls, delays and timeouts out of range, a mesh axis' size in --sizes, a
--backend axis the mesh does not have. The launcher is replaced by one that fails the
test, so a refusal that comes from a rank cannot pass."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dcpc import demo
from dcpc.harness import run
from dcpc.run_limits import MAX_CALLS, RunConfigError, check_options

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "schedules" / "kimi_k3_dcp.yaml")
TWO_LEVEL = str(ROOT / "schedules" / "gallery" / "hierarchical_two_level.yaml")


@pytest.mark.parametrize("args, words", [
    (["--calls", "100000000000000000000"],
     f"--calls must be an integer in 1..{MAX_CALLS}, got 100000000000000000000"),
    (["--calls", "0"], "--calls must be an integer in 1..10000, got 0"),
    (["--calls", "１０"], "'１０' is not an integer"),
    (["--calls", "1_0"], "'1_0' is not an integer"),
    (["--jitter-ms", "inf"], "--jitter-ms must be a finite number in 0..1000, got inf"),
    (["--jitter-ms", "1e7"], "--jitter-ms must be a finite number in 0..1000"),
    (["--jitter-ms", "-1"], "--jitter-ms must be a finite number in 0..1000"),
    (["--jitter-ms", "nan"], "--jitter-ms must be a finite number in 0..1000, got nan"),
    (["--timeout", "0"], "--timeout (seconds) must be a finite number above 0"),
    (["--timeout", "-5"], "--timeout (seconds) must be a finite number above 0"),
    (["--timeout", "nan"], "--timeout (seconds) must be a finite number above 0"),
    (["--wait-timeout", "-1"], "--wait-timeout (seconds) must be a finite number in 0.001"),
    (["--wait-timeout", "inf"], "--wait-timeout (seconds) must be a finite number in 0.001"),
    (["--sizes", "T=１"], "size T: '１' is not an integer"),
])
def test_run_options_out_of_range_are_usage_errors(no_ranks, capsys, args: list[str],
                                                   words: str) -> None:
    """--calls 1e20 built the event plan of every call first (740 MB and 26 s per million
    calls), --jitter-ms inf raised OverflowError in every rank, 1e7 read as a hang,
    --timeout 0/-5/nan were accepted."""
    assert demo.main([KIMI, *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


@pytest.mark.parametrize("args, words", [
    (["--world", "2x2", "--sizes", "N=3"],
     "--sizes: N sizes a mesh axis, which --world 2x2 binds to 2, not 3"),
    (["--world", "2x2", "--backend", "nod=torch,gpu=host"],
     "--backend: HierarchicalTwoLevel: backend= names axis 'nod', which the mesh does not "
     "have (its axes: node, gpu)"),
])
def test_run_refuses_what_every_rank_would_refuse_before_starting_them(
        no_ranks, capsys, args: list[str], words: str) -> None:
    """--sizes N=3 against --world 2x2 was a raw traceback (InexactDivision of H/N); a
    --backend axis typo was refused by each of the W ranks after they started."""
    assert demo.main([TWO_LEVEL, *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_a_backend_mapping_on_a_plain_schedule_is_refused_before_starting(no_ranks,
                                                                          capsys) -> None:
    assert demo.main([KIMI, "--backend", "node=torch"]) == 2
    assert "--backend: KimiK3Dcp: backend= as a mapping" in capsys.readouterr().err


def test_run_config_is_checked_by_the_harness_too(no_ranks) -> None:
    """The harness's own entry point refuses the same values (engines' tests, scripts)."""
    for bad in ({"calls": 10**20}, {"jitter_s": math.inf}, {"timeout_s": 0.0},
                {"wait_timeout_s": math.nan}, {"calls": True}):
        with pytest.raises(RunConfigError):
            run.run_schedule(run.RunConfig(schedule=KIMI, **bad))


def test_check_options_accepts_the_defaults_and_the_edges() -> None:
    check_options(calls=1, jitter_s=0.0, timeout_s=None, wait_timeout_s=None)
    check_options(calls=MAX_CALLS, jitter_s=1.0, timeout_s=1e7, wait_timeout_s=1e-3)
    with pytest.raises(RunConfigError, match="--calls"):
        check_options(calls=MAX_CALLS + 1, jitter_s=0.0)
    with pytest.raises(RunConfigError, match="jitter_p"):
        check_options(calls=1, jitter_s=0.0, jitter_p=1.5)
