"""Comparing the happens-before checker with the execution oracle on one schedule.

    disagreements(schedule, worlds, ...) -> list[str]     (empty: they agree)

The checker (dcpc.check.hb) proves; the oracle (dcpc.check.oracle) runs the lowered
plan. They agree on a W when:

- races: the checker reports a race (kind, class, buffer, first step, second step)
  iff a run reaches it. (The oracle keeps, per instance, stream and access, only the
  latest call's access: that finds every racing step pair; the class and the order
  of the pair could in principle differ for an older call, never seen on 3,000
  schedules of up to 12 draws at W 2..5 with 4*slots calls. A shift's store in flight
  is kept per call: an older call's may still be in flight when a newer one starts,
  and the pair then names the older call's step first.)
- deadlocks: the checker reports one iff the oracle hangs; every wait the oracle finds
  stuck for good (nothing will ever satisfy it, or a cycle) is a checker deadlock on
  the same channel and steps; and a checker deadlock the oracle did not report is one
  it never got past in a stream's first call (it sits behind the hang the oracle did
  reach: the checker analyses every step, a run stops at the first hang).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

from dcpc.check import hb
from dcpc.check.oracle import OracleReport, explore
from dcpc.codegen.lower import lower
from dcpc.diagnostics import DiagnosticError


def channel_names(schedule: Any) -> dict[str, str]:
    """Step name -> the channel findings name (split-phase steps: their ``channel``)."""
    return {s.name: s.op.channel for s in schedule.step_list() if s.kind in ("signal", "wait")}


def compare(checker: Iterable[Any], oracle: OracleReport) -> list[str]:
    """What differs between the checker's findings and the oracle's, at one W."""
    def pair(kind: str, buffer: str, steps: Iterable[str]) -> tuple:
        return (kind, buffer, tuple(sorted(filter(None, steps))))

    found = list(checker)
    races = {f.key for f in found if f.kind == "race"}
    dead = {pair("deadlock", f.buffer, f.steps) for f in found if f.kind == "deadlock"}
    o_races = {f.key for f in oracle.findings if f.kind == "race"}
    o_dead = {pair("deadlock", f.buffer, f.key[3:]) for f in oracle.findings
              if f.kind == "deadlock"}
    out = []
    for p in sorted(races - o_races):
        out.append(f"the checker reports {p}, no run reaches it")
    reached = {f.key: f for f in oracle.findings}
    for p in sorted(o_races - races):
        out.append(f"a run reaches {p}, the checker proves it impossible: "
                   + reached[p].text())
    if bool(dead) != oracle.hung:
        out.append(f"the checker reports deadlocks {sorted(dead)}, the runs "
                   + (f"hang (spinning: {oracle.blocked})" if oracle.hung else "finish"))
    for p in sorted(o_dead - dead):
        out.append(f"a run is stuck for good at {p}, the checker does not say so")
    for f in found:
        if f.kind == "deadlock" and pair("deadlock", f.buffer, f.steps) not in o_dead \
                and oracle.passed_first_call(f.first.step):
            out.append(f"the checker reports deadlock {f.key}, a run got past "
                       f"'{f.first.step}' in a stream's first call")
    return out


def disagreements(schedule: Any, worlds: Iterable[int],
                  runs: Callable[[int], dict[str, Any]] = lambda world: {},
                  verdicts: collections.Counter[str] | None = None) -> list[str]:
    """Every disagreement over ``worlds``, each prefixed with its W. ``runs(W)``: the
    oracle's runs at W (explore's keywords: policies, randoms, seed, calls,
    exhaustive); ``verdicts`` counts the checker's verdicts (clean, race, deadlock)."""
    worlds = list(worlds)
    try:
        plan = lower(schedule, worlds)
    except DiagnosticError:
        if verdicts is not None:
            verdicts["refused"] += len(worlds)
        if hb.check(schedule, worlds, hints=False).findings:
            return []
        return ["the lowering refuses a schedule the checker finds clean"]
    names = channel_names(schedule)
    out = []
    for world in worlds:
        checker = hb.check(schedule, [world], hints=False).findings
        if verdicts is not None:
            kinds = {f.kind for f in checker}
            verdicts["deadlock" if "deadlock" in kinds else "race" if kinds else "clean"] += 1
        oracle = explore(plan, world, channels=names, **runs(world))
        out += [f"W={world}: {d}" for d in compare(checker, oracle)]
    return out


def assert_three_agree(schedule: Any, want: set, label: str,
                       worlds: Iterable[int] = (2, 3, 4), executed: Iterable[int] = (2, 3)
                       ) -> None:
    """The checker and the brute force (tests/support/hb_oracle.py) find exactly ``want``
    at each of ``worlds``, and the execution oracle disagrees with the checker nowhere
    at ``executed``."""
    from support.hb_oracle import oracle_keys

    for world in worlds:
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert found == oracle_keys(schedule, world) == want, (label, world)
    assert disagreements(schedule, list(executed)) == [], label


def checker_covers(text: str, world: int, executed: bool = True) -> tuple[set, set]:
    """The checker's findings and the brute force's for schedule ``text`` at ``world``
    (parsed at that W: a perm is one schedule per W); asserts the structural check is
    clean, the checker reports every race the brute force (and, ``executed``, the
    execution oracle) finds, the same deadlocks, and no unwritten read."""
    from dcpc.check import structural
    from dcpc.lang.parse import parse_text
    from support.hb_oracle import oracle_keys, oracle_unwritten

    schedule = parse_text(text, world=world)
    errors = [d for d in structural.check(schedule, [world]) if d.severity == "error"]
    assert errors == [], (text, world, errors)
    found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
    exact = oracle_keys(schedule, world)
    assert exact <= found, (text, world, exact - found)
    assert {k for k in found if k[0] == "deadlock"} == \
        {k for k in exact if k[0] == "deadlock"}, (text, world)
    assert oracle_unwritten(schedule, world) == set(), (text, world)
    if executed:
        run = explore(lower(schedule, [world]), world, channels=channel_names(schedule))
        assert {f.key for f in run.findings if f.kind == "race"} <= found, (text, world)
        assert run.hung == any(k[0] == "deadlock" for k in found), (text, world)
    return found, exact
