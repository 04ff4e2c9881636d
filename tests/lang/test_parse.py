"""The parse stage (dcpc/lang/parse.py, yamlsrc.py, model.py): YAML -> Schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpc.diagnostics import Diagnostic, DiagnosticError, Mark
from dcpc.lang import model
from dcpc.lang.parse import MAX_FILE_BYTES, parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
KIMI_PATH = ROOT / "schedules" / "kimi_k3_dcp.yaml"
KIMI = KIMI_PATH.read_text()


def parse_errors(text: str) -> list[Diagnostic]:
    with pytest.raises(DiagnosticError) as info:
        parse_text(text, "p.yaml")
    assert info.value.diagnostics
    return info.value.diagnostics


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


@pytest.mark.parametrize("path", sorted((ROOT / "schedules").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_schedules_parse(path: Path) -> None:
    schedule = parse_file(path)
    assert schedule.source_file == str(path)
    assert len(schedule.source_sha256) == 64
    assert [s.index for s in schedule.step_list()] == list(range(len(schedule.step_list())))


def test_contract_example_reads_as_documented() -> None:
    schedule = parse_file(KIMI_PATH)
    assert schedule.schedule == "kimi_k3_dcp" and schedule.slots == 2
    assert schedule.streams is model.Streams.per_slot
    assert schedule.sizes["D"] == 576
    assert schedule.sizes["T"].max == 512 and schedule.sizes["H"].multiple_of == "W"
    assert schedule.buffers["q_full"].is_symmetric
    assert schedule.buffers["lse_part"].lse_base == "e"
    assert [(s.name, s.kind) for s in schedule.step_list()] == [
        ("query_gather", "all_gather"), ("attention", "external"),
        ("out_exchange", "all_to_all"), ("merge", "lse_combine"),
    ]
    merge = schedule.step_list()[3].op
    assert merge.mask_empty is not None and merge.mask_empty.query_start_loc == "query_start_loc"


def test_marks() -> None:
    schedule = parse_file(KIMI_PATH)
    file = str(KIMI_PATH)
    assert schedule.mark("buffers/q_full", of_key=True) == Mark(file, 15, 3)
    assert schedule.mark("sizes/T", of_key=True) == Mark(file, 8, 3)
    assert schedule.mark("sizes/T") == Mark(file, 8, 6)
    steps = schedule.step_list()
    assert steps[1].mark() == Mark(file, 25, 5)
    assert steps[1].op.mark("reads[1]") == Mark(file, 25, 50)
    assert steps[0].op.mark("dim", of_key=True) == Mark(file, 24, 63)
    assert schedule.buffers["q_local"].mark("shape[1]") == Mark(file, 14, 26)


def test_lse_base_2_is_normalised_to_a_string() -> None:
    text = edit(KIMI, "dtype: f32, lse_base: e}", "dtype: f32, lse_base: 2}")
    assert parse_text(text).buffers["lse_part"].lse_base == "2"


# ---- messages --------------------------------------------------------------------

def test_union_wrong_type_is_one_message() -> None:
    found = parse_errors(edit(KIMI, "src: [o_part, lse_part]", "src: 3"))
    assert [d.message for d in found] == [
        "'steps.out_exchange.src' must be a name or a list of names, not an integer"
    ]
    assert (found[0].mark.line, found[0].mark.col, found[0].code) == (26, 41, "wrong-type")


def test_union_list_item_names_the_item() -> None:
    found = parse_errors(edit(KIMI, "src: [o_part, lse_part]", "src: [o_part, 7]"))
    assert [d.message for d in found] == [
        "'steps.out_exchange.src[1]' must be a string, not an integer"
    ]
    assert (found[0].mark.line, found[0].mark.col) == (26, 50)


def test_shape_item_of_wrong_type_is_one_message() -> None:
    found = parse_errors(edit(KIMI, "shape: [B],", "shape: [B, [2]],"))
    assert len(found) == 1
    assert found[0].message.startswith("'buffers.seq_lens.shape[1]' must be an integer or a size")


def test_size_of_wrong_type_is_one_message() -> None:
    found = parse_errors(edit(KIMI, "D: 576", "D: big"))
    assert [d.code for d in found] == ["wrong-type"]
    assert "size 'D' must be an integer or a mapping" in found[0].message


def test_unknown_top_level_key_hint_lists_only_language_keys() -> None:
    found = parse_errors(KIMI + "extra: 1\n")
    assert [d.code for d in found] == ["unknown-key"]
    assert found[0].hint is not None
    assert "src_mark" not in found[0].hint and "source_file" not in found[0].hint
    assert "steps" in found[0].hint


def test_unknown_key_did_you_mean() -> None:
    found = parse_errors(edit(KIMI, "mask_empty:", "mask_emtpy:"))
    assert found[0].hint == "did you mean 'mask_empty'?"


def test_every_parse_error_reported_at_once() -> None:
    text = edit(KIMI, "dtype: i32}", "dtype: int32}")
    text = edit(text, "op: external", "op: extrenal")
    text = edit(text, "slots: 2", "slots: 0")
    found = parse_errors(text)
    assert sorted(d.code for d in found) == ["bad-value", "out-of-range", "unknown-op"]


def test_duplicate_key_names_the_first() -> None:
    found = parse_errors(edit(KIMI, "slots: 2", "slots: 2\nslots: 3"))
    assert [d.code for d in found] == ["duplicate-key"]
    assert found[0].hint and "line 6" in found[0].hint


def test_deeply_nested_yaml_is_a_diagnostic() -> None:
    for text in ("[" * 5000, "a: " + "{x: " * 3000 + "1" + "}" * 3000):
        found = parse_errors(text)
        assert found[0].code in ("yaml-too-deep", "yaml-syntax")


def test_alias_bomb_is_a_diagnostic() -> None:
    text = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for name, prev in zip("bcdefg", "abcdef", strict=True):
        text += f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]\n"
    assert [d.code for d in parse_errors(text)] == ["yaml-too-large"]


def test_files(tmp_path: Path) -> None:
    with pytest.raises(DiagnosticError) as info:
        parse_file(tmp_path / "missing.yaml")
    assert info.value.diagnostics[0].code == "io"
    assert (info.value.diagnostics[0].mark.line, info.value.diagnostics[0].mark.col) == (1, 1)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(DiagnosticError) as info:
        parse_file(big)
    assert info.value.diagnostics[0].code == "too-large"


def test_python_tags_construct_nothing() -> None:
    found = parse_errors(edit(KIMI, "schedule: kimi_k3_dcp", "schedule: !!python/name:os.system"))
    assert found[0].code == "yaml-syntax"
    found = parse_errors(edit(KIMI, "slots: 2", "slots: !!python/object/apply:os.getpid []"))
    assert [d.code for d in found] == ["wrong-type"]  # a tagged sequence is only a list
