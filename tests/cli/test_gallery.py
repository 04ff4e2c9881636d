"""The layout gallery (schedules/gallery/): every layout proved, run and its wrong twins refused.

A gallery file is one published layout, written as its source describes it. Its header
says what it claims, and this test holds it to that:

    # gallery: <the layout's name as published>
    # check: 2..16            worlds `dcpc check` proves (ints and ranges; mesh shapes
    #                          such as 2x2 once the schedule declares a mesh)
    # run: 2 3 4              worlds CI runs on CPU against float64 (host backend)

A wrong twin lives in tests/gallery_twins/<gallery stem>.<what>.yaml:

    # twin-of: <gallery stem>
    # expect: <diagnostic code> <word> ...   e.g. `# expect: race write-after-read kv`

and must be refused by the pipeline (check, lower, hb) with a diagnostic of that code
whose message holds every word. A twin may also say what `dcpc run --replay` of its
counterexample shows (the raced output and the start of its first mismatch):

    # replay: <output> <first mismatch>   e.g. `# replay: q_h@regroup call 0 slot 0 rank 0`
"""

from __future__ import annotations

import json
import zlib
from functools import cache
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.gallery import CALLS, header, worlds

from dcpc import pipeline
from dcpc.cli import main
from dcpc.diagnostics import DiagnosticError
from dcpc.harness.replay import plan
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.worker import returned_names
from dcpc.lang import when as wh
from dcpc.lang.parse import parse_file
from dcpc.ops import OPS

ROOT = Path(__file__).resolve().parents[2]
GALLERY = sorted((ROOT / "schedules" / "gallery").glob("*.yaml"))
TWINS = sorted((ROOT / "tests" / "gallery_twins").glob("*.yaml"))


def test_every_gallery_file_states_its_claims_and_has_a_twin() -> None:
    twinned = {header(t, "twin-of") for t in TWINS}
    for path in GALLERY:
        for key in ("gallery", "check", "run"):
            assert header(path, key), f"{path.name} has no '# {key}:' header"
        assert path.stem in twinned, f"{path.name} has no wrong twin in tests/gallery_twins/"
    stems = {p.stem for p in GALLERY}
    for twin in TWINS:
        assert header(twin, "twin-of") in stems, f"{twin.name}: twin-of names no gallery file"
        assert header(twin, "expect"), f"{twin.name} has no '# expect:' header"


@pytest.mark.parametrize("path", GALLERY, ids=lambda p: p.stem)
def test_gallery_layout_is_proved_for_every_world_it_claims(path: Path) -> None:
    claimed = worlds(header(path, "check") or "")
    try:
        c = pipeline.run(path, pipeline.Options(worlds=claimed), until="emit")
    except DiagnosticError as err:  # a loop names a mesh axis' size: proved per shape
        # (above all of them, or another error), and a module is compiled for one shape
        if [d.code for d in err.diagnostics] != ["loop-world"]:
            raise
        c = pipeline.run(path, pipeline.Options(worlds=claimed[-1:]), until="emit")
    assert c.module_text, path.name


RUNS = [(p, w) for p in GALLERY for w in worlds(header(p, "run") or "")]


@pytest.mark.e2e
@pytest.mark.parametrize(("path", "world"), RUNS, ids=lambda v: getattr(v, "stem", str(v)))
def test_gallery_layout_matches_float64(path: Path, world: int) -> None:
    seed = zlib.crc32(f"{path.stem}/{world}".encode()) % 10_000
    config = RunConfig(schedule=str(path), world=world, backend="host", calls=CALLS, seed=seed)
    report = run_schedule(config)
    text = format_report(report)
    print(text)
    assert report.launch.ok, text + "\n" + "\n".join(o.traceback for o in report.launch.outcomes)
    assert report.mismatches == 0, text
    assert report.outputs, text
    schedule = parse_file(path, world)
    running = wh.running(schedule, world)  # a guarded step (when:): the ranks it runs on
    by_name = {s.name: s for s in schedule.step_list()}
    returned = returned_names(schedule, world)  # what each step's method returns
    for name, stats in report.outputs.items():
        # a buffer returned by k steps of a call is compared k times (a ring's receive
        # buffer at every other hop); a read by an external step once, on each rank that
        # runs it
        if "@" in name:
            ranks = len(running.get(by_name[name.split("@")[1]].index, range(world)))
            assert stats.compared == CALLS * ranks, (name, text)
            continue
        landing = [s for s in schedule.step_list()
                   if s.kind != "external" and name in OPS[s.kind].io(s.op)[1]]
        if not landing and schedule.slice_of(name) is not None:
            # a chunk of a slot (b[s][:, i]): no method lands it (its slot's shift does);
            # compared where the engine reads it, on each rank that runs the read
            reads = [s for s in schedule.step_list()
                     if s.kind == "external" and name in s.op.reads]
            assert stats.compared == CALLS * sum(
                len(running.get(s.index, range(world))) for s in reads), (name, text)
            continue
        k = sum(name in returned[s.name] for s in landing)
        if landing and not k:  # landed by steps that return nothing (ragged_all_to_all's
            # one-peer waits): compared where the engine reads it, at each external read
            k = sum(name in s.op.reads for s in schedule.step_list() if s.kind == "external")
        k = max(1, k)  # a cast's scales: sent, not in io's writes
        # a shift without wrap leaves the ranks with no source as they were: kept
        assert stats.compared + stats.kept == CALLS * world * k, (name, text)


def claims_of(twin: Path) -> str:
    """The worlds a twin is checked at: those its gallery file claims, as `--world` takes
    them (`2..4x1..4 1x2..4` -> `2..4x1..4,1x2..4`)."""
    original = ROOT / "schedules" / "gallery" / f"{header(twin, 'twin-of')}.yaml"
    return ",".join((header(original, "check") or "2..8").split())


@cache
def checked(twin: Path, text: str, claims: str) -> tuple[int, str, str]:
    """`dcpc check TWIN --world CLAIMS --format json`: its exit code, its JSON (stdout) and
    all it wrote (stderr too, for a failure's message), once per twin for the refusal test
    and the replay test both (keyed by the twin's text and the worlds too: all that
    decides the check)."""
    del text  # a key only: the check reads the file
    result = CliRunner().invoke(main, ["check", str(twin), "--world", claims,
                                       "--format", "json"])
    return result.exit_code, result.stdout, result.output


def check_twin(twin: Path) -> tuple[int, str, str]:
    return checked(twin, twin.read_text(), claims_of(twin))


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_wrong_twin_is_refused_with_its_class(twin: Path) -> None:
    """Refused by the pipeline (check, lower, hb) at every world its gallery file claims,
    with a diagnostic of the twin's code whose message holds every word."""
    code, *words = (header(twin, "expect") or "").split()
    exit_code, output, said = check_twin(twin)
    assert exit_code == 1, said
    (result,) = json.loads(output)["results"]
    assert not result["ok"], output
    found = [d for d in result["diagnostics"] if d["code"] == code]
    assert found, output
    assert any(all(w in d["message"] for w in words) for d in found), output


REPLAYED = [t for t in TWINS if header(t, "replay")]
REPLAY_SEEDS = 6  # runs of a replay at most, up to the first that shows its race


@pytest.mark.e2e
@pytest.mark.parametrize("twin", REPLAYED, ids=lambda p: p.stem)
def test_wrong_twin_s_replayed_race_shows_wrong_data(twin: Path, tmp_path: Path) -> None:
    """`dcpc check --format json` of the twin (at its gallery file's claims: the refusal
    test's check), then its first race replayed on real ranks (host backend): the held
    step reads or keeps the raced instance's wrong data."""
    output, first = (header(twin, "replay") or "").split(" ", 1)
    exit_code, checked_json, said = check_twin(twin)
    assert exit_code == 1, said
    found = tmp_path / "race.json"
    found.write_text(checked_json)
    replay = plan(str(found), str(twin), None)
    # A twin races everywhere, not only where the replay holds: the free ranks run as the
    # machine lets them, and on a loaded one their own races can carry the very block the
    # held step should see into the buffer it reads (seen at a load of 10: 6 mismatches,
    # none at the held read; meta_cp_pass_q.no_hop_credit failed so with seeds 0 and 1
    # both). The hold itself is an ordering wait, so each run must be released by the
    # other access; the race must show at the held read in one of SEEDS runs, taken in
    # order up to the first that shows it (one run where the machine is not loaded). A
    # replay that no longer shows the race fails every run: the test fails.
    shown: list[str] = []
    for seed in range(REPLAY_SEEDS):
        # a long wait: the hold lasts at most half of it, and a loaded machine is slow
        report = run_schedule(RunConfig(schedule=str(twin), world=replay.world, backend="host",
                                        calls=replay.calls, wait_timeout_s=240, replay=replay,
                                        seed=seed))
        text = format_report(report)
        assert report.replay_outcome.startswith("released"), text
        stats = report.outputs[output]
        if stats.mismatches and stats.first_mismatch.startswith(first):
            return
        shown.append(f"seed {seed}: {stats.mismatches} mismatches at {output} "
                     f"({stats.first_mismatch or 'none'}), "
                     f"{sum(s.mismatches for s in report.outputs.values())} in all")
    pytest.fail(f"{REPLAY_SEEDS} replays of the race, none showed it at {output} "
                f"({first}):\n" + "\n".join(shown) + "\n" + text)
