"""The happens-before checker on the corpus of broken schedules and their fixed twins."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.hb_oracle import oracle_keys

from dcpc.check import hb, structural
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "hb_corpus"
REFUSED = re.compile(r"^# refused: (\S+) (\S+)$", re.M)
ALL_BROKEN = sorted(p for p in CORPUS.glob("*.yaml") if not p.name.endswith(".fixed.yaml"))
# What the emitted code cannot do is refused before the happens-before stage.
REFUSED_FILES = [p for p in ALL_BROKEN if REFUSED.search(p.read_text())]
BROKEN = [p for p in ALL_BROKEN if p not in REFUSED_FILES]
FIXED = sorted(CORPUS.glob("*.fixed.yaml"))
SHIPPED = sorted((ROOT / "schedules").glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (race|deadlock) (\S+) (\S+) (\S+) (\S+) W=(\d+)$", re.M)


def expectations(path: Path) -> tuple[dict[tuple[str, ...], int], str | None]:
    text = path.read_text()
    found = {(k, c, b, s1, "" if s2 == "-" else s2): int(w)
             for k, c, b, s1, s2, w in EXPECT.findall(text)}
    hint = re.search(r"^# hint: (.+)$", text, re.M)
    return found, hint.group(1) if hint else None


def test_corpus_is_big_and_every_bug_has_a_twin() -> None:
    assert len(BROKEN) >= 12
    assert {p.name.replace(".yaml", ".fixed.yaml") for p in ALL_BROKEN} == {
        p.name for p in FIXED}
    firsts = {next(iter(expectations(p)[0])) for p in BROKEN}
    classes = {(k[0], k[1]) for p in BROKEN for k in expectations(p)[0]}
    assert {("race", "write-after-read"), ("race", "read-after-write"),
            ("race", "write-after-write"), ("deadlock", "cycle"),
            ("deadlock", "no-signal")} <= classes
    assert len(firsts) >= 8  # distinct (kind, class, buffer, steps) headlines


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_schedule_reports_exactly_the_expected_findings(path: Path) -> None:
    expected, hint = expectations(path)
    assert expected, f"{path.name} has no '# expect:' header"
    report = hb.check(parse_file(path), range(2, 9))
    got = {f.key: f.world for f in report.findings}
    assert got == expected
    headline = next(iter(expected))
    finding = next(f for f in report.findings if f.key == headline)
    assert hint is not None and finding.hint is not None and hint in finding.hint, finding.hint
    assert not report.ok


@pytest.mark.parametrize("path", REFUSED_FILES, ids=lambda p: p.stem)
def test_refused_schedule_is_a_located_structural_error(path: Path) -> None:
    code, step = REFUSED.search(path.read_text()).groups()  # type: ignore[union-attr]
    hint = re.search(r"^# hint: (.+)$", path.read_text(), re.M)
    schedule = parse_file(path)
    errors = [d for d in structural.check(schedule, range(2, 9)) if d.severity == "error"]
    assert [d.code for d in errors] == [code]
    wait = next(s for s in schedule.step_list() if s.name == step)
    assert errors[0].mark.line == wait.op.mark("from").line or errors[0].mark == wait.mark()
    assert step in errors[0].message
    assert hint is not None and errors[0].hint is not None and hint.group(1) in errors[0].hint


@pytest.mark.parametrize("path", BROKEN + FIXED, ids=lambda p: p.name)
def test_checker_agrees_with_the_brute_force_oracle(path: Path) -> None:
    schedule = parse_file(path)
    for world in (2, 3, 4, 5):
        checker = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert checker == oracle_keys(schedule, world), world


@pytest.mark.parametrize("path", FIXED, ids=lambda p: p.stem)
def test_fixed_twin_checks_clean(path: Path) -> None:
    report = hb.check(parse_file(path), range(2, 33))
    assert report.findings == []
    assert report.ok and report.diagnostics() == []


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_schedules_check_clean_for_w_2_to_72(path: Path) -> None:
    report = hb.check(parse_file(path), range(2, 73))
    assert report.findings == [], [f.message for f in report.findings]
    assert report.stats["worlds"] == 71
    assert report.stats["events"] > 0


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_diagnostics_point_at_the_later_step_and_say_what(path: Path) -> None:
    report = hb.check(parse_file(path), range(2, 9))
    for finding, diag in zip(report.findings, report.diagnostics(), strict=True):
        assert diag.code == finding.kind
        assert diag.mark.file == str(path) and diag.mark.line > 0
        later = finding.second if finding.kind == "race" else finding.first
        assert later is not None and diag.mark == later.mark
        assert finding.buffer in diag.message and f"W={finding.world}" in diag.message
        for step in filter(None, finding.steps):
            assert step in diag.message
        assert diag.message.count(". ") == 0  # one sentence
        assert any(line.strip().startswith("rank ") for line in diag.notes)
        assert diag.hint == finding.hint
        assert path.name in diag.render()


def test_json_report_round_trips() -> None:
    path = CORPUS / "shared_recv_two_slots.yaml"
    data = hb.check(parse_file(path), range(2, 5)).as_json()
    again = json.loads(json.dumps(data))
    assert again["ok"] is False and again["worlds"] == [2, 4]
    classes = {f["class"] for f in again["findings"]}
    assert classes == {"write-after-read", "read-after-write", "write-after-write"}
    first = again["findings"][0]
    assert set(first["first"]) == {"rank", "call", "slot", "step", "step_index", "access",
                                   "region", "mark", "owner"}  # owner: whose instance
    assert first["timeline"] and first["hint"]
