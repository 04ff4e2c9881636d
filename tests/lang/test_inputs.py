"""Issue 13 items 1, 2, 5 and 10: hostile input text, numbers, characters and paths.

Every case goes through the real command line (click's runner, in process) and must
end in exit 0, 1 or 2 with located diagnostics, never an internal error (exit 3).
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dcpc.cli import main
from dcpc.diagnostics import Diagnostic, Mark, printable
from dcpc.lang.sizes import MAX_SIZE

ROOT = Path(__file__).resolve().parents[2]
KIMI = (ROOT / "schedules" / "kimi_k3_dcp.yaml").read_text()
KV = ROOT / "schedules" / "kv_gather.yaml"
LOCATED = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+):(?P<col>\d+): (error|warning): ")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def write(tmp_path: Path, text: str, name: str = "t.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def errors_of(output: str) -> list[re.Match[str]]:
    return [m for m in map(LOCATED.match, output.splitlines()) if m]


def edit(old: str, new: str, text: str = KIMI) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


# ---- item 1: tags whose text they cannot read ------------------------------------

@pytest.mark.parametrize("value, says", [
    ("!!int abc", "'abc' is not an integer"), ("!!bool maybe", "'maybe' is not true or false"),
    ("!!timestamp x", "'x' is not a date or time"), ("!!int ''", "'' is not an integer"),
    ("!!int 0x", "'0x' is not an integer"), ("!!float x", "'x' is not a number"),
    ("!!timestamp 2026-13-45", "is not a date or time"),
])
def test_bad_tag_content_is_a_located_diagnostic(tmp_path: Path, value: str, says: str) -> None:
    path = write(tmp_path, edit("slots: 2", f"slots: {value}"))
    result = invoke("check", path)
    assert result.exit_code == 1, result.output
    assert f"{path}:6:8: error: " in result.output and says in result.output
    assert "[bad-tag-value]" in result.output


def test_a_tag_with_no_safe_constructor_is_refused_where_it_stands(tmp_path: Path) -> None:
    path = write(tmp_path, edit("D: 576", "D: !!python/object/apply:os.getpid 576"))
    result = invoke("check", path)
    assert result.exit_code == 1
    assert f"{path}:11:6: error: invalid YAML: the tag " in result.output


# ---- item 2: huge numbers, bounded sizes and buffers ---------------------------

@pytest.mark.parametrize("number", ["9" * 5000, "0x" + "f" * 3600, "-" + "1" * 31,
                                    "0" + "7" * 40, "1_000_000_000_000_000_000_000_000_000_000"])
def test_integers_of_more_than_30_digits_are_refused_at_their_place(tmp_path: Path,
                                                                     number: str) -> None:
    path = write(tmp_path, edit("D: 576", f"D: {number}"))
    for command in ("check", "compile"):
        args = [command, path] + (["-o", str(tmp_path / "out")] if command == "compile" else [])
        result = invoke(*args)
        assert result.exit_code == 1, result.output
        assert f"{path}:11:6: error: this integer has more than 30 digits [number-too-large]" \
            in result.output


@pytest.mark.parametrize("old, new, code, where", [
    ("D: 576", "D: 1000000000000000000000000000000" [:30], "size-too-large", "11:6"),
    ("D: 576", f"D: {MAX_SIZE + 1}", "size-too-large", "11:6"),
    ("T: {max: 512}", f"T: {{max: {2**40}}}", "size-too-large", "8:12"),
    ("H: {multiple_of: W}", "H: {multiple_of: '100000000000*W'}", "size-too-large", "10:20"),
    ("shape: [T, H/W, D],", "shape: [T, H/W, '2147483647*D'],", "dim-too-large", "14:31"),
    ("D: 576", "D: 2000000000", "buffer-too-large", "14:3"),
])
def test_sizes_dimensions_and_bytes_are_bounded_at_check_time(
    tmp_path: Path, old: str, new: str, code: str, where: str
) -> None:
    path = write(tmp_path, edit(old, new))
    result = invoke("check", "--world", "2", path)
    assert result.exit_code == 1, result.output
    assert f"{path}:{where}: error: " in result.output and f"[{code}]" in result.output, \
        result.output


def test_the_largest_sizes_the_limits_allow_still_compile(tmp_path: Path) -> None:
    """At the limit: T at 2**31-1 over a one-byte row is a buffer of about 2 GiB."""
    text = KV.read_text().replace("N: {max: 65536}", f"N: {{max: {MAX_SIZE // 8}}}")
    text = text.replace("K: 576", "K: 1")
    path = write(tmp_path, text)
    result = invoke("compile", "--world", "2", path, "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    compile((tmp_path / "out" / "kv_gather.py").read_text(), "kv_gather.py", "exec")


def test_the_limits_are_documented() -> None:
    doc = (ROOT / "docs" / "language.md").read_text()
    assert "## Limits" in doc
    for word in ("2**31-1", "1 TiB", "30 digits", "1 MiB", "number-too-large",
                 "size-too-large", "dim-too-large", "buffer-too-large"):
        assert word in doc, word


# ---- item 5: control characters and names with ':' --------------------------------

def test_no_message_carries_a_raw_control_character() -> None:
    diag = Diagnostic(Mark("a\nb.yaml", 3, 4), "x", "name 'q\n1:1: error: forged'",
                      hint="\x1b[31mred\x07", notes=("\u202etxt",))
    text = diag.render()
    assert text.count("\n") == 2  # the message, one note and the hint: three lines
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert text.startswith("a\\nb.yaml:3:4: error: name 'q\\n1:1: error: forged' [x]")
    assert printable("plain é ü 中") == "plain é ü 中"


@pytest.mark.parametrize("key", [
    '"q\\nt.yaml:1:1: error: forged [x]"', '"q\\e[31mred\\a"', '"a:b"', '"key:x"', "'a: b'",
])
def test_odd_buffer_names_are_reported_escaped_at_their_line(tmp_path: Path, key: str) -> None:
    path = write(tmp_path, edit("  q_local:", f"  {key}:"))
    result = invoke("check", path)
    assert result.exit_code == 1
    assert "\x1b" not in result.output and "\x07" not in result.output
    for line in result.output.splitlines():  # every line is a diagnostic or indented
        assert LOCATED.match(line) or line.startswith("  "), line
    found = [m for m in errors_of(result.output) if "must match" in m.string]
    assert found and all((m["line"], m["col"]) == ("14", "3") for m in found), result.output


@pytest.mark.parametrize("char, line, col", [("\x07", 6, 9), ("\x00", 11, 7), ("\x1b", 24, 5)])
def test_control_characters_are_reported_at_their_line_and_column(
    tmp_path: Path, char: str, line: int, col: int
) -> None:
    old, new = {6: ("slots: 2", "slots: 2" + char), 11: ("D: 576", "D: 5" + char + "76"),
                24: ("  - query", "  - " + char + "query")}[line]
    text = edit(old, new)
    path = write(tmp_path, text)
    result = invoke("check", path)
    assert result.exit_code == 1
    assert f"{path}:{line}:{col}: error: invalid YAML: the control character {char!r} " \
        "is not allowed" in result.output
    assert "position" not in result.output and char not in result.output
    assert len(result.output.strip().splitlines()) == 2  # the error and its hint


def test_yaml_syntax_errors_stay_on_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, edit("slots: 2", "slots: [2\n  x: {"))
    result = invoke("check", path)
    assert result.exit_code == 1
    (first, *rest) = result.output.strip().splitlines()
    assert LOCATED.match(first) and all(line.startswith("  ") for line in rest)


# ---- item 10: files and paths ------------------------------------------------------

def test_missing_input_exits_2_located_at_the_file(tmp_path: Path) -> None:
    for command in ("check", "compile", "graph"):
        args = [command, str(tmp_path / "nope.yaml")]
        args += ["-o", str(tmp_path / "o")] if command == "compile" else []
        result = invoke(*args)
        assert result.exit_code == 2, (command, result.output)
        assert f"{tmp_path / 'nope.yaml'}:1:1: error: cannot read the file: No such file" \
            in result.output


def test_non_regular_inputs_are_refused_without_reading_them(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    for path, kind in (("/dev/zero", "a character device"), (str(fifo), "a FIFO")):
        done = subprocess.run([sys.executable, "-m", "dcpc", "check", path],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"{path}:1:1: error: cannot read the schedule: it is {kind}" in done.stderr


def test_inputs_are_read_up_to_the_cap(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB that is never read
    result = invoke("check", str(big))
    assert result.exit_code == 1
    assert "[too-large]" in result.output


def _compile(tmp_path: Path, outdir: str, *extra: str):
    return invoke("compile", str(KV), *extra, "-o", outdir, "--world", "2")


@pytest.mark.parametrize("outdir", ["/proc/self", "/proc/dcpc-nope/x", "LONG"])
def test_unwritable_outputs_are_io_diagnostics(tmp_path: Path, outdir: str) -> None:
    if outdir == "LONG":
        outdir = str(tmp_path / ("d" * 300))
    result = _compile(tmp_path, outdir)
    assert result.exit_code == 2, result.output
    assert "cannot write the file" in result.output and "[io]" in result.output
    assert "internal error" not in result.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_an_io_diagnostic(tmp_path: Path) -> None:
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        result = _compile(tmp_path, str(out))
    finally:
        out.chmod(0o755)
    assert result.exit_code == 2 and "Permission denied" in result.output


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_a_full_disk_leaves_the_old_module_whole(tmp_path: Path) -> None:
    """A write that fails half way (a file size limit: the disk is 'full' at 4 KiB)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "kv_gather.py").write_text("OLD = 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "dcpc", "compile", str(KV), "-o", str(out), "--world", "2"],
        capture_output=True, text=True, timeout=120, preexec_fn=_limit_file_size)
    assert done.returncode == 2, done.stderr
    assert f"{out / 'kv_gather.py'}:1:1: error: cannot write the file: File too large" \
        in done.stderr
    assert (out / "kv_gather.py").read_text() == "OLD = 1\n"
    assert sorted(p.name for p in out.iterdir()) == ["kv_gather.py"]  # no temporary left


def test_modules_are_written_whole(tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper"
    result = _compile(tmp_path, str(out))
    assert result.exit_code == 0, result.output
    text = (out / "kv_gather.py").read_text()
    compile(text, "kv_gather.py", "exec")
    assert sorted(p.name for p in out.iterdir()) == ["kv_gather.py"]


@pytest.mark.parametrize("command, names", [
    (["schema", "-o"], ["x.json"]), (["graph", str(KV), "-o"], ["x.dot", "x.svg"]),
])
def test_schema_and_graph_into_a_missing_folder(tmp_path: Path, command: list[str],
                                                names: list[str]) -> None:
    for name in names:
        target = tmp_path / "missing" / name
        result = invoke(*command, str(target))
        assert result.exit_code == 2, result.output
        assert f"{target}:1:1: error: cannot write the file: the folder" in result.output
        assert "Traceback" not in result.output


def test_two_inputs_with_one_schedule_name_are_refused(tmp_path: Path) -> None:
    copy = write(tmp_path, KV.read_text().replace("# ", "#  "), "copy.yaml")
    out = tmp_path / "out"
    result = invoke("compile", str(KV), copy, "-o", str(out), "--world", "2")
    assert result.exit_code == 1
    assert f"{copy}:1:11: error: schedule 'kv_gather' is also the name of {KV}'s schedule" \
        in result.output
    assert "[duplicate-schedule]" in result.output
    assert (out / "kv_gather.py").exists()  # the first one, untouched by the second


def test_file_names_with_control_characters_are_escaped_everywhere(tmp_path: Path) -> None:
    odd = tmp_path / "a\x1b[31mb\nc.yaml"
    odd.write_text(KV.read_text())
    for args in (["check", "--world", "2"], ["compile", "--world", "2", "-o", str(tmp_path)]):
        result = invoke(*args, str(odd))
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output and result.output.count("\n") == 1
        assert "a\\x1b[31mb\\nc.yaml" in result.output


@pytest.mark.parametrize("item", ["{}", "{a: {op: barrier}, b: {op: barrier}}"])
def test_a_step_item_that_is_empty_or_double_is_located(tmp_path: Path, item: str) -> None:
    path = write(tmp_path, edit("  - out_exchange:", f"  - {item}\n  - out_exchange:"))
    result = invoke("check", "--world", "2", path)
    assert result.exit_code == 1, result.output
    assert f"{path}:26:" in result.output and "[bad-step]" in result.output, result.output
