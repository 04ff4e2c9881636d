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
from support.import_graph import RUNTIME_SHARED

from dcpc.cli import main
from dcpc.harness.launch import LaunchResult
from dcpc.harness.run import RunConfig, RunReport, format_report, run_schedule

ROOT = Path(__file__).resolve().parents[2]
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
    config.schedule = "odd\x1b[31m\n.yaml"
    text = format_report(RunReport(config, "kv_gather", LaunchResult(2, [], 0.0)))
    assert "(odd\\x1b[31m\\n.yaml)" in text and "\x1b" not in text


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


# ---- item 13: the facts docs/engines.md states ---------------------------------------

def test_a_generated_module_needs_none_of_the_compilers_dependencies(tmp_path: Path) -> None:
    assert CliRunner().invoke(main, ["compile", KV, "-o", str(tmp_path), "--world", "2"]
                              ).exit_code == 0
    code = (
        "import sys\n"
        "for name in ('pydantic', 'networkx', 'jinja2', 'yaml', 'click'):\n"
        "    sys.modules[name] = None  # an import of any of them now fails\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import kv_gather\n"
        "print(sorted(m for m in sys.modules if m.startswith('dcpc.') and\n"
        f"             not m.startswith('dcpc.runtime') and m not in {sorted(RUNTIME_SHARED)}))\n")
    done = dcpc(code=code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"  # nothing of the compiler (the shared leaves: stdlib, torch)


def test_the_cpu_interpreter_truncates_f32_to_bf16() -> None:
    """docs/engines.md 1a: the host backend's kernels round toward zero, torch to nearest,
    so the two agree within one bf16 step."""
    code = """
import torch, triton, triton.language as tl

@triton.jit
def to_bf16(x, y, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i).to(tl.bfloat16))

x = torch.tensor([1 + 3 * 2**-9, -(1 + 3 * 2**-9), 1 + 2**-9 + 2**-12, 3.0], dtype=torch.float32)
y = torch.empty(4, dtype=torch.bfloat16)
to_bf16[(1,)](x, y, BLOCK=4)
print(y.float().tolist(), x.to(torch.bfloat16).float().tolist())
"""
    done = dcpc(code=code, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr
    interpreted, rounded = _two_lists(done.stdout)
    assert interpreted == [1.0, -1.0, 1.0, 3.0]  # toward zero
    assert rounded == [1.0078125, -1.0078125, 1.0, 3.0]  # to nearest
    assert all(abs(a - b) <= 2**-7 * abs(b) for a, b in zip(interpreted, rounded, strict=True))


def _two_lists(text: str) -> tuple[list[float], list[float]]:
    import json

    first, second = text.strip().split("] [")
    return json.loads(first + "]"), json.loads("[" + second)


def test_the_readme_run_works_from_a_shell_without_triton_interpret() -> None:
    """The README's main job as a shell runs it: no TRITON_INTERPRET in the environment.
    (Everything else in this suite runs with it set by conftest, which hid a parent
    process importing Triton before its spawned ranks set the interpreter.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = dcpc("run", str(ROOT / "schedules" / "kimi_k3_dcp.yaml"), "--world", "2",
                "--backend", "host", "--calls", "4", env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK: every output matches (0 mismatches)" in done.stdout, done.stdout
    assert "Traceback" not in done.stdout + done.stderr


# ---- dcpc run on a GPU, and what the CPU run adds (issue 29) ------------------------------

@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine with a GPU")
def test_run_on_cuda_without_a_gpu_says_so_before_any_work() -> None:
    done = dcpc("run", KV, "--device", "cuda", "--world", "2")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--device cuda: no CUDA GPU is visible to torch here" in done.stderr
    assert "sizes" not in done.stdout  # refused before compiling or binding anything
    assert "Traceback" not in done.stderr


def test_run_repeats_with_the_next_seeds_and_writes_every_run_as_json(tmp_path: Path) -> None:
    import json

    out = tmp_path / "runs.json"
    done = dcpc("run", KV, "--world", "2", "--calls", "2", "--repeat", "2", "--seed", "7",
                "--programs", "2", "--program-order", "reverse", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    records = json.loads(out.read_text())
    assert [r["seed"] for r in records] == [7, 8] and all(r["ok"] for r in records)
    assert records[0]["programs"] == 2 and records[0]["device"] == "cpu"
    assert set(records[0]["outputs"]) >= {"kv_full"}
    assert done.stdout.count("result     OK") == 2 and "run        2 of 2" in done.stdout


@pytest.mark.parametrize("args,said", [
    (["--repeat", "0"], "--repeat must be in 1..1000"),
    (["--programs", "0"], "--programs must be in 1..1024"),
    (["--program-order", "random"], "invalid choice: 'random'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_run_refuses_bad_gpu_and_order_options(args: list[str], said: str) -> None:
    done = dcpc("run", KV, *args)
    assert done.returncode == 2 and said in done.stderr, done.stderr
