"""The happens-before checker against the execution oracle (issue 12's acceptance).

The checker (dcpc.check.hb) proves; the oracle (dcpc.check.oracle) executes the
lowered plan, the signal slots and epochs the kernels use, and reports what its runs
reach. They must agree (tests/support/exec_oracle_agree.py says exactly how) on 2,000 random
schedules (tests/support/exec_oracle_gen.py) for W = 2..5, on every corpus file and on every
shipped schedule. A disagreement prints the schedule's YAML.

Runs: every (schedule, W) gets the ``lockstep`` run (lowest call first: each wait
passes on the first store that satisfies it, the fewest orderings any run can have;
see dcpc/check/oracle.py), and one W per schedule also a ``hold``, ``random`` or
``delay`` run; corpus and shipped files get lockstep, hold and four random/delay runs
at every W.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

import pytest
from support.exec_oracle_agree import channel_names, compare, disagreements
from support.exec_oracle_gen import load, schedule_text, valid_schedule

from dcpc.check import hb, structural
from dcpc.check.oracle import explore, program
from dcpc.codegen.lower import lower
from dcpc.diagnostics import DiagnosticError
from dcpc.lang.parse import parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
CORPUS = sorted((ROOT / "tests" / "hb_corpus").glob("*.yaml"))
SHIPPED = sorted((ROOT / "schedules").glob("*.yaml"))
WORLDS = range(2, 6)
SEEDS, CHUNKS = 2000, 8
EXTRA = ("hold", "random", "delay")


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_checker_and_oracle_agree_on_random_schedules(chunk: int) -> None:
    per = SEEDS // CHUNKS
    verdicts: collections.Counter[str] = collections.Counter()
    problems = []
    for seed in range(chunk * per, (chunk + 1) * per):
        text, schedule = valid_schedule(seed, WORLDS)
        extra_world = 2 + seed % 4

        def runs(world: int, seed: int = seed, extra_world: int = extra_world) -> dict:
            extra = (EXTRA[seed % 3],) if world == extra_world else ()
            return {"policies": ("lockstep",) + extra, "seed": seed}

        found = disagreements(schedule, WORLDS, runs=runs, verdicts=verdicts)
        if found:
            problems.append(f"seed {seed}:\n  " + "\n  ".join(found) + "\n" + text)
    assert not problems, f"{len(problems)} disagreements; the first:\n" + "\n".join(problems[:2])
    # the draws are not trivial: every verdict occurs (per (schedule, W))
    total = sum(verdicts[k] for k in ("clean", "race", "deadlock"))
    assert total == per * len(WORLDS) - verdicts["refused"]
    assert verdicts["race"] >= total // 10 and verdicts["deadlock"] >= total // 40
    assert verdicts["clean"] >= total // 2


def test_the_random_schedules_cover_issue_12s_classes() -> None:
    """The generator's texts (cheap: no parsing) cover every class, many times."""
    texts = [schedule_text(seed) for seed in range(SEEDS)]
    patterns = {
        "several signals on one channel": r"channel: (c\d+)\}[\s\S]*signal[^\n]*channel: \1\}",
        "ring to next": r"to: next", "ring to prev": r"to: prev",
        "wait from next": r"from: next", "wait from prev": r"from: prev",
        "fused": r"all_to_all_combine", "fused own part from a symmetric src": r"src: \[os",
        "reduce_scatter": r"reduce_scatter", "implicit via": r"reduce_scatter[^\n]*dim: 1\}",
        "shared": r"shared: true", "single stream": r"streams: single",
        "per_slot": r"streams: per_slot", "3 slots": r"slots: 3", "1 slot": r"slots: 1\n",
        "external writes a symmetric buffer": r"writes: \[(s0|g0|os)\]",
        "external reads a symmetric buffer": r"reads: \[(g0|g1|a0|s0|r0|os|osl|vo|vl)",
        "interleaved gather": r"interleave: 2",
    }
    for what, pattern in patterns.items():
        hits = sum(1 for t in texts if re.search(pattern, t))
        assert hits >= SEEDS // 25, (what, hits)
    rarer = {  # drawn in place of some reduce_scatters (the other draws stay as they were)
        "all_reduce": r"all_reduce", "implicit all_reduce via": r"reduce: sum\}",
        "all_to_all split/concat": r"concat_dim: 0",
        "broadcast": r"op: broadcast", "reduce to a root": r"op: reduce,",
    }
    for what, pattern in rarer.items():
        hits = sum(1 for t in texts if re.search(pattern, t))
        assert hits >= SEEDS // 80, (what, hits)


def test_the_fast_loader_gives_the_parsers_model() -> None:
    for seed in range(100):
        text = schedule_text(seed)
        assert load(text).model_dump() == parse_text(text).model_dump(), text


def _corpus_ids(path: Path) -> str:
    return path.name


@pytest.mark.parametrize("path", CORPUS + SHIPPED, ids=_corpus_ids)
def test_checker_and_oracle_agree_on_the_corpus(path: Path) -> None:
    schedule = parse_file(path)
    errors = [d for d in structural.check(schedule, WORLDS) if d.severity == "error"]
    try:
        lower(schedule, WORLDS)
    except DiagnosticError as err:  # nothing to execute: the schedule must be rejected
        checker = hb.check(schedule, WORLDS, hints=False).findings
        assert errors or checker, f"the lowering refuses a clean schedule: {err}"
        return
    found = disagreements(schedule, WORLDS, runs=lambda world: {
        "policies": ("lockstep", "hold"), "randoms": 4, "seed": world})
    assert not found, "\n".join(found) + "\n" + path.read_text()


# --- the oracle would have caught issue 12's bugs ------------------------------------

def _old_polls(schedule, plan):  # type: ignore[no-untyped-def]
    """The plan as the old lowering emitted it: every wait polled the FIRST signal
    step of its channel (dcpc/codegen/rules.py ``_wait`` before issue 12)."""
    prog = program(plan, channel_names(schedule))
    first: dict[str, int] = {}
    for step in schedule.step_list():
        if step.kind == "signal":
            first.setdefault(step.op.channel, step.index)
    steps = tuple(
        dataclasses.replace(s, polls=first[schedule.step_list()[s.index].op.channel])
        if schedule.step_list()[s.index].kind == "wait" else s
        for s in prog.steps)
    return dataclasses.replace(prog, steps=steps)


CORPUS_DIR = ROOT / "tests" / "hb_corpus"


@pytest.mark.parametrize(("name", "world", "verdict"), [
    ("several_signals_one_channel.fixed", 2, "race"),  # the second wait passes at once
    ("ring_two_hops", 3, "race"),  # one hop only
    ("ring_both_directions.fixed", 3, "hang"),  # the wait from next never passes
])
def test_the_oracle_finds_the_old_lowerings_bugs(name: str, world: int, verdict: str) -> None:
    path = CORPUS_DIR / f"{name}.yaml"
    schedule = parse_file(path)
    plan = lower(schedule, WORLDS)
    names = channel_names(schedule)
    now = explore(plan, world, channels=names, policies=("lockstep", "hold"), randoms=2)
    assert now.findings == [] and not now.hung
    old = explore(_old_polls(schedule, plan), world, policies=("lockstep", "hold"))
    if verdict == "hang":
        assert old.hung
    else:
        assert any(f.kind == "race" and f.buffer == "q_full" for f in old.findings)
        assert not old.hung


def test_the_old_checkers_fused_model_misses_the_race_the_code_has() -> None:
    """The fused exchange reads its own part from src after its wait (the code); the
    old checker put every src read before the signal and so missed the race."""
    schedule = parse_file(CORPUS_DIR / "fused_src_after_wait.yaml")
    prog = program(lower(schedule, WORLDS))
    code = explore(prog, 2)
    assert ("race", "o_part") in {(f.kind, f.buffer) for f in code.findings}
    steps = tuple(dataclasses.replace(s, after=tuple(a for a in s.after if a[0] != "o_part"))
                  if s.name == "combine" else s for s in prog.steps)
    assert explore(dataclasses.replace(prog, steps=steps), 2).findings == []


def test_lockstep_reaches_what_every_interleaving_reaches_on_small_random_plans() -> None:
    """The claim the agreement rests on (one lockstep run has the fewest orderings any
    run has), checked against the exhaustive search on small random schedules."""
    compared = 0
    for seed in range(400):
        text, schedule = valid_schedule(seed, WORLDS, max_steps=3)
        if schedule.slots > 2 or len(schedule.step_list()) > 4:
            continue
        plan = lower(schedule, WORLDS)
        for world in (2, 3):
            calls = 2 * plan.slots
            try:
                every = explore(plan, world, calls=calls, exhaustive=True, limit=3000)
            except RuntimeError:  # too many states for a test
                continue
            one = explore(plan, world, calls=calls, policies=("lockstep",))
            assert (one.keys(), one.hung) == (every.keys(), every.hung), text
            compared += 1
        if compared >= 60:
            break
    assert compared >= 60


def test_the_agreement_test_catches_a_checker_that_unrolls_too_few_calls() -> None:
    """Not vacuous: with one call fewer than its bound (2*slots - 1 per rank), the
    checker misses races between calls that the runs reach."""
    caught = 0
    for seed in range(300):
        _, schedule = valid_schedule(seed, WORLDS)
        plan = lower(schedule, WORLDS)
        names = channel_names(schedule)
        for world in (2, 3):
            short = hb.check(schedule, [world], hints=False, calls=2 * schedule.slots - 1)
            caught += bool(compare(short.findings, explore(plan, world, channels=names)))
    assert caught >= 10  # 22 of 600 today


def test_the_agreement_test_catches_the_old_lowerings_polls_on_random_schedules() -> None:
    """Issue 12's bug 1 at scale: where a channel has several signal steps, executing
    the old lowering (every wait polling the channel's first signal) disagrees with
    the checker's proof (races, or hangs) on many schedules."""
    tried = caught = 0
    for seed in range(200):
        text, schedule = valid_schedule(seed, WORLDS)
        signals = collections.Counter(s.op.channel for s in schedule.step_list()
                                      if s.kind == "signal")
        if not signals or max(signals.values()) < 2:
            continue
        plan = lower(schedule, WORLDS)
        old = _old_polls(schedule, plan)
        tried += 1
        caught += any(compare(hb.check(schedule, [w], hints=False).findings, explore(old, w))
                      for w in (2, 3, 4))
    assert tried >= 40 and caught >= tried // 5, (tried, caught)  # 101 and 30 today


CHUNK_SEEDS = 24


@pytest.mark.parametrize("seed", range(0, CHUNK_SEEDS, 6))
def test_three_models_agree_on_a_ring_read_block_by_block(seed: int) -> None:
    """tests/lang/slot_chunk_axis0.yaml with random changes (exec_oracle_gen
    ``chunk_ring_text``): a local read of a slot's chunk beside ragged puts into the
    slot's blocks, apart where the block is another (chunk-precise). The checker and
    the brute force find the same races, and the execution oracle agrees, at W = 2, 3."""
    from support.exec_oracle_gen import chunk_ring_text
    from support.hb_oracle import oracle_keys

    for one in range(seed, seed + 6):
        text, names = chunk_ring_text(one)
        for world in (2, 3):
            schedule = parse_text(text, "ring.yaml", world)
            found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
            assert found == oracle_keys(schedule, world), (one, names, world)
            assert disagreements(schedule, [world]) == [], (one, names, world, text)


def test_the_ring_draws_cover_every_change_and_both_verdicts() -> None:
    from support.exec_oracle_gen import CHUNK_CHANGES, chunk_ring_text

    drawn, verdicts = set(), set()
    for one in range(CHUNK_SEEDS):
        text, names = chunk_ring_text(one)
        drawn |= set(names)
        schedule = parse_text(text, "ring.yaml", 3)
        verdicts.add(bool(hb.check(schedule, [3], hints=False).findings))
    assert drawn == set(CHUNK_CHANGES) and verdicts == {True, False}, (drawn, verdicts)
