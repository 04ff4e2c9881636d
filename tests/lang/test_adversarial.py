"""Issue 13's acceptance, property-based: hostile schedules through the real command line.

Each example takes a shipped schedule and injects one or two of the classes the issue
found: YAML tags with bad content, huge numbers, long and odd names (unicode, ':',
spaces, control characters, Python keywords), raw control characters in the text,
step items that are empty, double or not mappings.
Whatever comes out, ``dcpc check`` exits 0, 1 or 2, never with an internal error or
a traceback, and every error line is located (``file:line:col``, line and column from
1). A schedule ``check`` accepts, ``compile`` accepts, and the module it writes
imports. Non-regular and missing inputs are covered by the deterministic cases at
the end.

The example count is the "dcpc-adversarial" profile (DCPC_ADVERSARIAL_EXAMPLES,
default 800: about 15 s on one core).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcpc.cli import main
from dcpc.runtime.loading import import_file, schedule_class

ROOT = Path(__file__).resolve().parents[2]
BASES = {p.stem: p.read_text() for p in sorted((ROOT / "schedules").glob("*.yaml"))}
SMALL = ("kv_gather", "kimi_k3_dcp")  # the fuzzed bases: the smallest and the contract's

settings.register_profile(
    "dcpc-adversarial",
    max_examples=int(os.environ.get("DCPC_ADVERSARIAL_EXAMPLES", "800")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)
PROFILE = settings.get_profile("dcpc-adversarial")

# ---- what gets injected -------------------------------------------------------------

TAGS = ["!!int", "!!bool", "!!float", "!!timestamp", "!!null", "!!str", "!!binary", "!!seq",
        "!!map", "!!python/name:os.system", "!!python/object/apply:os.getpid", "!foo"]
TAG_TEXT = st.sampled_from(["abc", "maybe", "x", "''", "0x", "0b", "0o7", "1e999", "-",
                            "2026-13-45", "@@", "12", "true", "~", "[1]", "{a: 1}", "0x1F"])
CONTROL = st.sampled_from(["\x00", "\x01", "\x07", "\x08", "\x0b", "\x0c", "\x1b", "\x7f",
                           "\x85", "\u2028", "\u202e", "\ufeff", "\x1b[31m", "\r"])
NAME_CHARS = st.sampled_from(list("abcxyz_019") + [":", " ", "-", ".", "é", "ß", "中", "\n",
                                                   "\t", "\x1b", "\x07", "\x00", "\u202e",
                                                   "'", '"', "\\", "#", "{", "}", "[", ","])
NAMES = st.one_of(
    st.text(NAME_CHARS, min_size=1, max_size=12),
    st.from_regex(r"[a-z][a-z0-9_]{0,30}", fullmatch=True),  # valid: most pass check
    st.from_regex(r"[a-z][a-z0-9_]{0,30}", fullmatch=True),
    st.integers(40, 60).map(lambda n: "b" * n),  # around the longest name allowed
    st.integers(100, 300).map(lambda n: "b" * n),
    st.integers(200, 300).map(lambda n: "a" * n),  # long names
    st.sampled_from(["_1", "class", "None", "W", "self", "__x", "x" * 64, "grid", "close",
                     "T", "q_full", "rank", "buffer", "sizes", "step_0", "_", "a:b", "é"]),
)


def _number(kind: str, digits: int, sign: str) -> str:
    if kind == "dec":
        return sign + "9" * digits
    if kind == "hex":
        return sign + "0x" + "f" * digits
    if kind == "oct":
        return sign + "0" + "7" * digits
    return sign + "1_" * digits + "0"


VALID = st.from_regex(r"[a-z][a-z0-9_]{0,46}", fullmatch=True)  # mostly accepted names
NUMBERS = st.one_of(
    st.builds(_number, st.sampled_from(["dec", "hex", "oct", "under"]),
              st.sampled_from([1, 9, 10, 11, 19, 20, 29, 30, 31, 40, 400, 3600, 4301, 6000]),
              st.sampled_from(["", "-", "+"])),
    st.integers(-(10**40), 10**40).map(str),
    st.sampled_from(["2147483647", "2147483648", "4294967296", "1099511627776", "0", "-1"]),
)

SCALAR = re.compile(r"(?<=: )(\d+|true|false|bf16|f32|i32|e|W|max)(?=[,}\s])")
INTEGER = re.compile(r"(?<=: )\d+(?=[,}\s])|(?<=\[)\d+(?=[,\]])")
IDENT = re.compile(r"(?<![\w.])([A-Za-z_][A-Za-z0-9_]*)(?=[:,\]}\s/*+-])")


def _names(text: str) -> list[str]:
    """Schedule, size, buffer and step names of a shipped schedule (not keys of the language)."""
    import yaml

    data = yaml.safe_load(text)
    names = [data["schedule"], *data.get("sizes", {}), *data["buffers"]]
    names += [name for item in data["steps"] for name in item]
    return sorted(set(names) - {"W"})


def _quoted(name: str) -> str:
    return json.dumps(name)  # a JSON string is a YAML double-quoted scalar


NAMES_OF = {base: _names(BASES[base]) for base in SMALL}


@st.composite
def hostile(draw: st.DrawFn) -> str:
    base = draw(st.sampled_from(SMALL))
    text = BASES[base]
    for _ in range(draw(st.sampled_from([1, 1, 2]))):
        kind = draw(st.sampled_from(["tag", "number", "name", "valid-name", "control",
                                     "control-in-name", "step-item"]))
        if kind == "tag":
            sites = list(SCALAR.finditer(text))
            site = draw(st.sampled_from(sites))
            value = f"{draw(st.sampled_from(TAGS))} {draw(TAG_TEXT)}"
            text = text[:site.start()] + value + text[site.end():]
        elif kind == "number":
            sites = list(INTEGER.finditer(text))
            site = draw(st.sampled_from(sites))
            text = text[:site.start()] + draw(NUMBERS) + text[site.end():]
        elif kind in ("name", "valid-name", "control-in-name"):
            old = draw(st.sampled_from(NAMES_OF[base]))
            new = draw(VALID if kind == "valid-name" else NAMES)
            if kind == "control-in-name":
                at = draw(st.integers(0, len(new)))
                new = new[:at] + draw(CONTROL) + new[at:]
            if text.startswith(f"schedule: {old}\n"):
                new = new[:200]  # a module file name must fit the file system (item 3)
            pattern = re.compile(rf"(?<![\w.]){re.escape(old)}(?![\w])")
            text = pattern.sub(_quoted(new).replace("\\", "\\\\"), text)
        elif kind == "step-item":  # an item that is empty, double, a list or a scalar
            item = draw(st.sampled_from([
                "{}", "[]", "x", "~", "{a: {op: barrier}, b: {op: barrier}}",
                "{c: {op: barrier}}", "{d: }", "{e: {op: }}"]))
            lines = text.split("\n")
            starts = [i for i, line in enumerate(lines) if line.startswith("  - ")]
            lines.insert(draw(st.sampled_from(starts)), f"  - {item}")
            text = "\n".join(lines)
        else:
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(CONTROL) + text[at:]
    return text


# ---- what must hold -------------------------------------------------------------

def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def assert_clean(output: str, path: str, code: int) -> None:
    """Exit 0, 1 or 2; no traceback; every error and warning line located in ``path``."""
    assert code in (0, 1, 2), (code, output)
    assert "Traceback" not in output and "internal error" not in output, output
    head = re.escape(path)
    for line in output.splitlines():
        if not line or line.startswith("  "):
            continue  # a note or a hint of the diagnostic above
        if re.match(rf"^{head}: ok \(", line) or line.startswith(f"{path} -> "):
            continue
        found = re.match(rf"^{head}:(\d+):(\d+): (error|warning): \S", line)
        assert found, f"not a located diagnostic: {line!r}\n{output}"
        assert int(found[1]) >= 1 and int(found[2]) >= 1, line
    for ch in ("\x00", "\x07", "\x1b", "\x7f", "\u202e"):
        assert ch not in output, f"raw {ch!r} in the output"


def check_then_compile(tmp_path: Path, text: str, index: int) -> int:
    path = tmp_path / f"s{index}.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    checked = invoke("check", "--world", "2", str(path))
    assert_clean(checked.output, str(path), checked.exit_code)
    if checked.exit_code != 0:
        return checked.exit_code
    out = tmp_path / f"out{index}"
    compiled = invoke("compile", "--world", "2", str(path), "-o", str(out))
    assert_clean(compiled.output, str(path), compiled.exit_code)
    assert compiled.exit_code == 0, f"check accepted, compile refused:\n{compiled.output}"
    (module,) = out.glob("*.py")
    name = f"dcpc_adversarial_{index}"
    schedule_class(import_file(module, name))  # it imports (kernels only defined), one class
    sys.modules.pop(name, None)
    return 0


COUNTER = iter(range(10**9))


@PROFILE
@given(text=hostile())
def test_hostile_schedules_end_in_located_diagnostics(tmp_path_factory, text: str) -> None:
    tmp = tmp_path_factory.mktemp("adv", numbered=True)
    code = check_then_compile(tmp, text, next(COUNTER))
    if os.environ.get("DCPC_ADVERSARIAL_LOG"):
        with open(os.environ["DCPC_ADVERSARIAL_LOG"], "a") as log:
            log.write(f"{code}\n")


@pytest.mark.parametrize("base", sorted(BASES))
def test_the_bases_themselves_pass(tmp_path: Path, base: str) -> None:
    assert check_then_compile(tmp_path, BASES[base], 0) == 0


def test_a_long_name_and_a_huge_number_together(tmp_path: Path) -> None:
    text = BASES["kv_gather"].replace("kv_full", "k" * 280).replace("576", "9" * 5000)
    assert check_then_compile(tmp_path, text, 0) == 1


# ---- inputs that are not regular files -----------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "directory", "missing", "dev-zero", "dev-null",
                                  "link-to-dev-zero", "empty"])
def test_inputs_that_are_not_schedules(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "s.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "empty":
        path.write_text("")
    elif kind.startswith("dev-"):
        path = Path("/dev/" + kind[4:])
    for command in (["check"], ["compile", "-o", str(tmp_path / "out")], ["graph"]):
        result = invoke(*command, str(path))
        assert_clean(result.output, str(path), result.exit_code)
        assert result.exit_code == (1 if kind == "empty" else 2), result.output
        assert result.output.startswith(f"{path}:1:1: error: ")
