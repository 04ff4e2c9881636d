"""Split-phase sync: what `dcpc check` proves is what the emitted kernels do.

Each schedule under tests/sync_regressions raced or hung under the old code (a wait
polled the FIRST signal step of its channel, while the checker matched the k-th wait
with the k-th signal) or was refused although it works. Each states its verdict; the
checker must give exactly that, the plan must poll the signal step the language
matches, and where it is clean the generated module runs clean at W=3 (W=2 where
only that is clean) on the host backend with jitter.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dcpc.diagnostics import DiagnosticError
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.pipeline import Options, run

HERE = Path(__file__).resolve().parents[1] / "sync_regressions"
CASES = sorted(HERE.glob("*.yaml"))
VERDICT = re.compile(r"^# verdict: clean 2\.\.(\d+)(?:; race (\d+))?$", re.M)


def verdict(path: Path) -> tuple[int, int | None]:
    found = VERDICT.search(path.read_text())
    assert found, f"{path.name} has no '# verdict:' line"
    return int(found.group(1)), int(found.group(2)) if found.group(2) else None


def findings(path: Path, worlds: range) -> list[tuple[str, int]]:
    try:
        run(path, Options(worlds=list(worlds)), until="hb")
    except DiagnosticError as err:
        c = err.compilation  # type: ignore[attr-defined]
        assert c.hb_report is not None, err  # every case passes the structural checks
        return [(f.kind, f.world) for f in c.hb_report.findings]
    return []


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_checker_gives_the_stated_verdict(path: Path) -> None:
    clean_to, race_at = verdict(path)
    assert findings(path, range(2, clean_to + 1)) == []
    if race_at is not None:
        assert ("race", race_at) in findings(path, range(2, race_at + 1))


def _polls(path: Path) -> dict[str, str]:
    plan = run(path, Options(worlds=[2], hb=False), until="lower").plan
    return {s.name: plan.steps[s.sync.polls].name for s in plan.steps
            if s.op == "wait" and s.sync.polls is not None}


def test_each_wait_polls_the_signal_step_it_is_matched_with() -> None:
    assert _polls(HERE / "split_twice.yaml") == {
        "early_wait": "early_signal", "late_wait": "late_signal"}
    assert _polls(HERE / "ring_two_hops.yaml") == {
        "hop1_wait": "hop1_signal", "hop2_wait": "hop2_signal"}
    assert _polls(HERE / "ring_both_ways.yaml") == {
        "from_prev": "to_next", "from_next": "to_prev"}
    assert _polls(HERE / "all_then_prev.yaml") == {"acquire": "release"}


def _config(path: Path, world: int, calls: int = 24, **kw: object) -> RunConfig:
    return RunConfig(schedule=str(path), world=world, backend="host", calls=calls, seed=5,
                     jitter_s=0.004, jitter_p=0.5, **kw)  # type: ignore[arg-type]


@pytest.mark.e2e
@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_clean_verdict_runs_clean_at_w3(path: Path) -> None:
    world = min(3, verdict(path)[0])
    report = run_schedule(_config(path, world))
    text = format_report(report)
    assert report.launch.ok, text + "\n".join(o.traceback for o in report.launch.outcomes)
    assert report.mismatches == 0, text
    assert report.outputs and all(
        s.compared >= 24 * world for s in report.outputs.values()), text


@pytest.mark.e2e
def test_the_old_polling_races_under_the_same_run() -> None:
    """Mutation: make late_wait poll early_signal's slots, as the old code did. The same
    run must then see a peer's next gather overwrite q_full under attention."""
    path = HERE / "split_twice.yaml"
    polls = _polls(path)
    plan = run(path, Options(worlds=[2], hb=False), until="lower").plan
    index = {s.name: s.index for s in plan.steps}
    slots = plan.slots
    own = f"                {index['late_wait'] * slots} + slot,\n"
    good = own + f"                {index[polls['late_wait']] * slots} + slot,\n"
    old = own + f"                {index['early_signal'] * slots} + slot,\n"
    pause = {"rank": 0, "call": -1, "step": "attention", "kind": "pause", "seconds": 0.5}
    report = run_schedule(_config(path, 3, calls=6, fault=pause, module_patch=((good, old),)))
    assert report.mismatches > 0, format_report(report)
    # the same pause with the emitted polling: clean
    report = run_schedule(_config(path, 3, calls=6, fault=pause))
    assert report.launch.ok and report.mismatches == 0, format_report(report)
