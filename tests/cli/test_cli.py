"""The command line: exit codes, output formats, the schema, the stage table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from dcpc.cli import main, parse_worlds
from dcpc.pipeline import STAGE_NAMES, run

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "schedules").glob("*.yaml"))
KIMI = ROOT / "schedules" / "kimi_k3_dcp.yaml"


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_shipped_schedules_exist():
    assert len(SHIPPED) >= 5


@pytest.mark.parametrize("spec, want", [
    ("2..8", list(range(2, 9))), ("2,4,8", [2, 4, 8]), ("4", [4]), ("2..4,8", [2, 3, 4, 8]),
])
def test_parse_worlds(spec, want):
    assert parse_worlds(spec) == want


@pytest.mark.parametrize("spec", ["1..8", "8..2", "x", "2..", "0", "2..5000"])
def test_bad_world_is_a_usage_error(spec):
    result = invoke("check", "--world", spec, str(KIMI))
    assert result.exit_code == 2
    assert "Traceback" not in result.output


def test_check_shipped_schedules_exit_0():
    result = invoke("check", *map(str, SHIPPED))
    assert result.exit_code == 0, result.output
    for path in SHIPPED:
        assert f"{path}: ok" in result.output


def test_check_reports_errors_with_position_and_exit_1(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(KIMI.read_text().replace("dim: 1}", "dmi: 1}", 1))
    result = invoke("check", str(bad))
    assert result.exit_code == 1
    assert f"{bad}:24:63: error: unknown key 'dmi'" in result.output
    assert "hint: did you mean 'dim'?" in result.output


def test_check_json_format(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(KIMI.read_text().replace("slots: 2", "slots: two", 1))
    result = invoke("check", "--format", "json", str(KIMI), str(bad))
    assert result.exit_code == 1
    data = json.loads(result.output)
    ok, failed = data["results"]
    assert ok["ok"] is True and failed["ok"] is False
    (diag,) = failed["diagnostics"]
    assert (diag["line"], diag["col"], diag["code"]) == (6, 8, "wrong-type")


def test_missing_file_is_a_diagnostic_not_a_traceback(tmp_path):
    result = invoke("check", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2  # a usage error, as docs/language.md says
    assert f"{tmp_path / 'nope.yaml'}:1:1: error: cannot read the file" in result.output
    assert "Traceback" not in result.output


def test_graph_prints_dot():
    result = invoke("graph", str(KIMI))
    assert result.exit_code == 0
    assert result.output.startswith('digraph "kimi_k3_dcp"')
    assert '"buf:q_full" -> "step:attention" [style=dashed];' in result.output
    assert '"step:query_gather" -> "buf:q_full" [style=solid];' in result.output


def test_graph_render_without_dot_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no 'dot' program on this PATH
    result = invoke("graph", str(KIMI), "-o", str(tmp_path / "g.svg"))
    assert result.exit_code == 2
    assert "apt-get install graphviz" in result.output


def test_graph_writes_dot_file(tmp_path):
    result = invoke("graph", str(KIMI), "-o", str(tmp_path / "g.dot"))
    assert result.exit_code == 0
    assert (tmp_path / "g.dot").read_text().startswith("digraph")


def test_schema_validates_shipped_schedules_and_rejects_unknown_keys():
    result = invoke("schema")
    assert result.exit_code == 0
    schema = json.loads(result.output)
    for path in SHIPPED:
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    broken = yaml.safe_load(KIMI.read_text())
    broken["steps"][0]["query_gather"]["dmi"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    broken = yaml.safe_load(KIMI.read_text())
    broken["buffers"]["q_full"]["dtype"] = "bf17"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_dump_parse_stage():
    result = invoke("compile", str(KIMI), "-o", "unused", "--dump", "parse")
    assert result.exit_code == 0
    dumped = json.loads(result.output)
    assert dumped["schedule"] == "kimi_k3_dcp"
    assert "__mark__" not in result.output


def test_stage_table_order_and_until():
    assert STAGE_NAMES == ("parse", "graph", "check", "lower", "hb", "emit")
    c = run(KIMI, until="graph")
    assert c.graph is not None and c.plan is None
    assert list(c.seconds) == ["parse", "graph"]


def test_the_semantics_table_is_made_once_per_schedule(monkeypatch: pytest.MonkeyPatch):
    """The parse stage makes each schedule's semantics table and every later stage reads
    that one (a per-W file: one schedule, so one table, per W), with no cache behind it."""
    import dcpc.lang.semantics as semantics
    from dcpc.pipeline import Options

    made: list[object] = []

    class Counted(semantics.Scope):  # table() makes one Scope per table
        def __init__(self, schedule: object) -> None:
            made.append(schedule)
            super().__init__(schedule)

    monkeypatch.setattr(semantics, "Scope", Counted)
    c = run(KIMI, Options(worlds=(2, 3, 4)))
    assert made == [c.schedule] and c.semantics == semantics.table(c.schedule)
    made.clear()
    ring = ROOT / "schedules" / "gallery" / "ring_attention.yaml"
    c = run(ring, Options(worlds=(2, 3, 4)), until="hb")
    assert c.per_world == [2, 3, 4] and len(made) == 3


@pytest.mark.parametrize("module", ["dcpc", "dcpc.cli"])
def test_module_entry_point_runs(module):
    # `python -m dcpc.cli` once imported the commands and exited 0 having done nothing
    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "dcpc" in done.stdout


def test_check_json_carries_the_race_as_data():
    broken = ROOT / "tests" / "hb_corpus" / "query_no_exchange.yaml"
    result = invoke("check", "--format", "json", str(broken))
    assert result.exit_code == 1
    (entry,) = json.loads(result.output)["results"]
    assert [d["code"] for d in entry["diagnostics"]] == ["race", "race"]
    # the attention's read, and the engine's read of what the gather returned
    reads, returns = sorted(entry["hb"]["findings"], key=lambda f: "returned" in f["first"])
    for finding in (reads, returns):
        assert (finding["kind"], finding["class"], finding["buffer"]) == (
            "race", "write-after-read", "q_full")
        assert finding["first"]["rank"] != finding["second"]["rank"]
    assert {reads["first"]["step"], reads["second"]["step"]} == {"attention", "query_gather"}
    assert "returned" not in reads["first"] and "returned" not in reads["second"]
    assert (returns["first"]["step"], returns["first"]["returned"]) == ("query_gather", True)
    assert returns["second"]["step"] == "query_gather" and "returned" not in returns["second"]


def test_graph_hb_highlights_the_conflict():
    broken = ROOT / "tests" / "hb_corpus" / "query_no_exchange.yaml"
    result = invoke("graph", "--hb", "--world", "2", str(broken))
    assert result.exit_code == 0
    assert result.output.startswith("digraph")
    assert "red" in result.output
    assert "\\n" in result.output and "\\\\n" not in result.output  # line breaks, once escaped


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graph_renders_png_with_dot(tmp_path):
    for args in (["graph", str(KIMI)], ["graph", "--hb", str(ROOT / "schedules/kv_gather.yaml")]):
        target = tmp_path / "g.png"
        result = invoke(*args, "-o", str(target))
        assert result.exit_code == 0, result.output
        assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_reader_that_leaves_early_ends_the_command_quietly() -> None:
    """`dcpc check ... | head -1` printed "dcpc: internal error: BrokenPipeError" (exit 3);
    now the command stops as a Unix tool does on SIGPIPE (141), with nothing on stderr."""
    files = sorted(str(p) for p in (ROOT / "schedules" / "ops").glob("*.yaml"))
    proc = subprocess.Popen([sys.executable, "-m", "dcpc", "check", *files],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert b": ok (" in proc.stdout.readline()
    proc.stdout.close()  # the reader leaves; the next line's write breaks the pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 141, err
    assert err == b"", err
