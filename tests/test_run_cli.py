"""Issue 13 items 11, 12 and 14: ``dcpc run`` and its harness, as a newcomer meets them.

Real processes throughout: the command line in a subprocess, the harness across
spawned ranks. No output may carry a Python traceback unless --debug is given.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dcpc.cli import main
from dcpc.harness.launch import LaunchResult
from dcpc.harness.run import RunConfig, RunReport, format_report, run_schedule

ROOT = Path(__file__).resolve().parents[1]
KV = str(ROOT / "schedules" / "kv_gather.yaml")
HARNESS = ROOT / "tests" / "harness"


def dcpc(*args: str, env: dict[str, str] | None = None, code: str | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "dcpc", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env or {**os.environ})


# ---- item 11 ----------------------------------------------------------------------

def test_run_help_lists_its_options() -> None:
    done = dcpc("run", "--help")
    assert done.returncode == 0, done.stderr
    for option in ("--world", "--backend", "--calls", "--seed", "--order", "--timeout",
                   "--debug", "--no-poison"):
        assert option in done.stdout, option


@pytest.mark.parametrize("world", ["1", "0", "x", "2..4", "65"])
def test_run_world_is_checked_like_every_other_world(world: str) -> None:
    done = dcpc("run", KV, "--world", world)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    check = CliRunner().invoke(main, ["check", "--world", world, KV])
    if world in ("1", "0", "x"):  # the same message as `dcpc check`
        said = check.output.strip().splitlines()[-1].split(": ", 2)[-1]
        assert said in done.stderr, (said, done.stderr)


def test_run_reports_a_module_that_cannot_run_without_a_traceback(tmp_path: Path) -> None:
    """``schedule: _1`` once compiled into ``class 1(...)``: whatever the compiler does
    with such a name, ``dcpc run`` ends in a clear line, not a traceback."""
    odd = tmp_path / "odd.yaml"
    odd.write_text(Path(KV).read_text().replace("schedule: kv_gather", "schedule: _1"))
    done = dcpc("run", str(odd), "--calls", "1")
    assert done.returncode in (0, 1), done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_run_on_a_missing_file_is_a_usage_error() -> None:
    done = dcpc("run", "nope.yaml")
    assert done.returncode == 2
    assert "nope.yaml:1:1: error: cannot read the file" in done.stderr


# ---- item 12 ----------------------------------------------------------------------

def test_run_without_the_run_extra_says_what_to_install() -> None:
    hide = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None; "
            f"from dcpc.cli import main; main(['run', {KV!r}])")
    done = dcpc(code=hide)
    assert done.returncode == 2, done.stderr
    assert "pip install 'dcpc[run]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_host_backend_without_the_interpreter_refuses_at_construction(tmp_path: Path) -> None:
    code = f"""
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
from dcpc.runtime.host import HostHeap
try:
    HostHeap(None, "cpu")
except RuntimeError as exc:
    print(exc)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = dcpc(code=code, env=env)
    assert done.returncode == 0, done.stderr
    assert "set TRITON_INTERPRET=1" in done.stdout, done.stdout


def test_graph_world_needs_hb() -> None:
    result = CliRunner().invoke(main, ["graph", "--world", "3", KV])
    assert result.exit_code == 2 and "add --hb" in result.output


def test_wording_of_counts_and_worlds() -> None:
    config = RunConfig(schedule=KV, world=2, calls=1)
    text = format_report(RunReport(config, "kv_gather", LaunchResult(2, [], 0.0)))
    assert "W=2 (2 processes)" in text and "1 call," in text and "1 calls" not in text
    config.calls = 3
    assert "3 calls," in format_report(RunReport(config, "kv_gather", LaunchResult(2, [], 0.0)))
    check = CliRunner().invoke(main, ["check", "--world", "2", KV])
    assert "ok (W=2," in check.output and "W 2..2" not in check.output


# ---- item 14 ----------------------------------------------------------------------

def _ok(report: RunReport) -> str:
    text = format_report(report)
    assert report.launch.ok, text + "\n".join(o.traceback for o in report.launch.outcomes)
    assert report.mismatches == 0, text
    return text


def test_a_buffer_written_twice_in_a_call_is_compared_with_each_write() -> None:
    report = run_schedule(RunConfig(schedule=str(HARNESS / "written_twice.yaml"), world=2,
                                    calls=3, seed=1))
    _ok(report)
    # both gathers' results and both engine reads of `full` were compared
    assert report.outputs["full"].compared == 2 * 3 * 2  # two methods, 3 calls, 2 ranks
    assert report.outputs["full@engine"].compared == 3 * 2
    assert report.outputs["full@look"].compared == 3 * 2


def test_a_synthetic_external_writes_symmetric_memory_the_module_reads() -> None:
    """`produce` (the engine) writes the symmetric `stage`; `gather` sends it. Were the
    write kept outside the module, the gather would send poisoned NaN."""
    report = run_schedule(RunConfig(schedule=str(HARNESS / "external_writes_symmetric.yaml"),
                                    world=2, calls=3, seed=2))
    _ok(report)
    assert report.outputs["full"].compared == 3 * 2
