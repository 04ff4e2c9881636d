"""Warnings never stop the pipeline nor change the exit code; --strict makes them errors."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from dcpc.cli import main

ROOT = Path(__file__).resolve().parents[2]
RACY = (ROOT / "tests" / "hb_corpus" / "query_no_exchange.yaml").read_text()
CLEAN = (ROOT / "tests" / "hb_corpus" / "query_no_exchange.fixed.yaml").read_text()
UNUSED = "  spare: {shape: [T], dtype: f32}\n"  # an unused buffer: a warning


def with_warnings(text: str) -> str:
    """The schedule plus two warnings: an unused buffer, `streams` on one slot."""
    text = text.replace("buffers:\n", "buffers:\n" + UNUSED, 1)
    return text.replace("slots: 1\n", "slots: 1\nstreams: single\n", 1)


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_a_warning_does_not_hide_a_race(tmp_path: Path) -> None:
    path = tmp_path / "racy.yaml"
    path.write_text(with_warnings(RACY))
    result = invoke("check", "--world", "2..4", str(path))
    assert result.exit_code == 1
    assert "[unused-buffer]" in result.output and "[slots-streams]" in result.output
    assert "[race]" in result.output  # the happens-before stage ran


def test_warnings_alone_pass_check_and_compile(tmp_path: Path) -> None:
    path = tmp_path / "clean.yaml"
    path.write_text(with_warnings(CLEAN))
    checked = invoke("check", "--world", "2..4", str(path))
    assert checked.exit_code == 0, checked.output
    assert "[unused-buffer]" in checked.output and ": ok (" in checked.output
    out = tmp_path / "gen"
    compiled = invoke("compile", "--world", "2..4", str(path), "-o", str(out))
    assert compiled.exit_code == 0, compiled.output
    assert "[unused-buffer]" in compiled.output
    assert len(list(out.glob("*.py"))) == 1


def test_strict_makes_warnings_errors(tmp_path: Path) -> None:
    path = tmp_path / "clean.yaml"
    path.write_text(with_warnings(CLEAN))
    assert invoke("check", "--strict", str(path)).exit_code == 1
    out = tmp_path / "gen"
    assert invoke("compile", "--strict", str(path), "-o", str(out)).exit_code == 1
    assert not out.exists() or not list(out.glob("*.py"))
