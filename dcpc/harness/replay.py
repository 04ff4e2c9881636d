"""``dcpc run --replay FILE``: make the race of a checker's counterexample happen.

The happens-before checker names a race by its two accesses (``first``: what the
schedule means to happen first; ``second``: the access the schedule does not order
after it). A replay holds ``first``'s rank back before ``first``'s step of its call
until ``second`` has happened, so the run executes the bad interleaving and the
outputs mismatch the float64 reference. The hold is an ordering wait, not a tuned
sleep: it ends when ``second``'s write has landed in the raced instance (when that
instance is the held rank's own: it no longer holds what the held step should see, by
the float64 reference) or when ``second``'s rank has
finished ``second``'s step (a flag file), whichever comes first, and at the latest
after a bound (half a module's wait, so a peer waiting on the held rank never times
out); a hold that ends at the bound is reported as not forced.

Where the hold is (``Replay.at``): an access of ``first`` marked ``"returned": true``
is the engine's read of what ``first``'s step returned, made when the step has
returned (dcpc.check.hb.events); the race is a peer's write landing in that buffer
before the engine read it. The replay holds ``first``'s rank *after* the step returned
and before the harness compares what it returned, until ``second``'s write landed
(the watch) or its step ran (the flag): the comparison then sees ``second``'s data.
A returned read that is ``second`` (a read-after-write: the write is ``first``) of the
same call: its race is the read made before the write, so ``first``'s rank is held
before its writing step until the reader's step (its return compared) ran.
Of a later call than the write (two calls in flight sharing the buffer, review M1 of
issue 33 flaky23): reading before the earlier call's write harms nothing by itself (the
reader sees its own call's data); what goes wrong is that write landing late, after
the later call's own write and before the reader's comparison. So the reader is held
after its return (``at`` "after"), watching its instance, until the earlier call's
write landed, and the run's order of the two calls in flight puts the later call's
step before the earlier one's on every rank (adversary.plan_events ``lead``), so that
the stale write comes after the later call's own. Where the writer is the reader's own
rank, which runs one step at a time, the reader's return is compared before that rank
can run the earlier call's step: no hold forces that comparison to see the stale write.
The replay then holds the writer before its step as above (the stale write lands after
the later call's own, where a later read of the buffer shows it) and says so
(``Replay.unforced``): the run prints "NOT FORCED" with why, and an OK run is not
presented as a shown race.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcpc.run_limits import MAX_CALLS, MAX_RUN_WORLD

# What ``dcpc check --format json`` writes for one file is kilobytes (its timelines
# list one line per rank involved); a file far larger is not one, and is not read.
MAX_REPLAY_BYTES = 16 * 2**20


class ReplayError(ValueError):
    """A replay file that cannot be read, or a counterexample that does not apply to the
    schedule run (exit 2)."""


@dataclass(frozen=True)
class Replay:
    """What the ranks of a replay do: ``hold`` = (rank, call, step) waits ``at`` its
    step ("before" it, or "after" it returned, before what it returned is compared)
    until ``release`` = (rank, call, step) has run or, when ``watch`` names a buffer,
    until the held rank's own instance of it changes; at most ``hold_s``."""

    hold: tuple[int, int, str]
    release: tuple[int, int, str]
    watch: str | None
    text: str  # the finding's message, printed with the run
    world: int
    calls: int  # calls the replay needs: its later call + 1
    at: str = "before"  # "after": the held access is the engine's read of the return
    unforced: str = ""  # why the race's own read cannot be forced ("" where it can)

    def in_flight(self, schedule: Any) -> bool:
        """Whether the race is between two calls the interleaved order runs at once
        (calls 2k and 2k + 1 on their own slots and streams): then the run interleaves
        them, the other access's step first (adversary.plan_events' ``lead``)."""
        from dcpc.lang import model as m

        calls = sorted((self.hold[1], self.release[1]))
        return (calls[0] % 2 == 0 and calls[1] == calls[0] + 1 and schedule.slots >= 2
                and schedule.streams == m.Streams.per_slot)

    def worker_args(self, flag: str, hold_s: float) -> dict[str, Any]:
        return {"hold": list(self.hold), "release": list(self.release), "watch": self.watch,
                "at": self.at, "flag": flag, "hold_s": hold_s}


def _at(path: str, where: str, what: str) -> ReplayError:
    return ReplayError(f"--replay {path}: {where}: {what}")


def _findings(path: str, data: Any) -> list[tuple[str, Any]]:
    """(JSON path, finding) of every finding in what ``dcpc check --format json`` writes,
    an ``HbReport``'s JSON (``dcpc compile --dump hb``) or one finding."""
    if isinstance(data, dict) and "results" in data:
        results = data["results"]
        if not isinstance(results, list):
            raise _at(path, "results", "is not a list")
        out = []
        for i, result in enumerate(results):
            hb = result.get("hb") if isinstance(result, dict) else None
            if isinstance(hb, dict) and isinstance(hb.get("findings"), list):
                out += [(f"results[{i}].hb.findings[{j}]", f)
                        for j, f in enumerate(hb["findings"])]
        return out
    if isinstance(data, dict) and isinstance(data.get("findings"), list):
        return [(f"findings[{j}]", f) for j, f in enumerate(data["findings"])]
    if isinstance(data, dict) and "kind" in data:
        return [("(top level)", data)]
    raise _at(path, "(top level)", "is not a counterexample: write it with "
              "`dcpc check FILE --format json > FILE.json` (a schedule the checker refuses "
              "with a race)")


def _world(path: str, where: str, value: Any) -> int:
    """The counterexample's group size: W, or a mesh shape's text ('2x2')."""
    import click

    from dcpc.worlds import one_world

    ok = isinstance(value, str) or isinstance(value, int) and not isinstance(value, bool)
    try:
        if ok:
            return one_world(str(value), largest=MAX_RUN_WORLD)
    except click.BadParameter as exc:
        raise _at(path, where, f"{exc.message}, got {value!r}") from None
    raise _at(path, where, f"must be a group size (W or a mesh shape such as 2x2), got "
              f"{value!r}")


def _access(path: str, where: str, value: Any, world: int) -> tuple[int, int, str, str]:
    """(rank, call, step, access) of one side of a race, every field checked."""
    if not isinstance(value, dict):
        raise _at(path, where, "is not an object with rank, call, step and access")
    for key in ("rank", "call"):
        got = value.get(key)
        if isinstance(got, bool) or not isinstance(got, int):
            raise _at(path, f"{where}.{key}", f"must be an integer, got {got!r}")
    rank, call = value["rank"], value["call"]
    if not 0 <= rank < world:
        raise _at(path, f"{where}.rank", f"{rank} is not a rank of W={world} (0..{world - 1})")
    if not 0 <= call < MAX_CALLS:
        raise _at(path, f"{where}.call", f"{call} is not in 0..{MAX_CALLS - 1}")
    step, access = value.get("step"), value.get("access")
    if not isinstance(step, str) or not step:
        raise _at(path, f"{where}.step", f"must name a step, got {step!r}")
    if access not in ("read", "write"):
        raise _at(path, f"{where}.access", f"must be read or write, got {access!r}")
    if "returned" in value and (  # as the checker writes it: true on a read, or absent
            value["returned"] is not True or access != "read"):
        raise _at(path, f"{where}.returned", "must be true on a read (the engine's read of "
                  f"what the step returned) or absent, got {value['returned']!r}")
    return rank, call, step, access


def load(path: str) -> tuple[dict[str, Any], str]:
    """The first race of the counterexample file ``path``, checked field by field, and
    where it is in the file."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_REPLAY_BYTES:
            raise ReplayError(f"--replay {path}: {size} bytes, more than a counterexample "
                              f"takes (at most {MAX_REPLAY_BYTES}); give the file `dcpc check "
                              "--format json` wrote")
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayError(f"--replay {path}: cannot read it ({exc.__class__.__name__}: "
                          f"{getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReplayError(f"--replay {path}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg})"
                          ) from None
    except RecursionError:
        raise ReplayError(f"--replay {path}: nested too deeply to be a counterexample"
                          ) from None
    found = _findings(path, data)
    races = [(where, f) for where, f in found if isinstance(f, dict) and f.get("kind") == "race"]
    if not races:
        kinds = sorted({str(f.get("kind")) for _, f in found if isinstance(f, dict)})
        raise _at(path, "(top level)", "holds no race to replay" + (
            f" (only: {', '.join(kinds)}; a deadlock shows as a hang, no replay needed)"
            if kinds else ""))
    where, finding = races[0]
    return finding, where


def plan(path: str, schedule_path: str, world: int | None) -> Replay:
    """The replay of the first race in ``path`` on ``schedule_path``: the race must be one
    the checker finds in that schedule at the counterexample's W (else ReplayError)."""
    finding, where = load(path)
    w = _world(path, f"{where}.world", finding.get("world"))
    if world is not None and str(world) != str(w):
        raise _at(path, f"{where}.world", f"the race was found at W={w}, the run asks "
                  f"--world {world}: drop --world or give --world {w}")
    first = _access(path, f"{where}.first", finding.get("first"), w)
    second = _access(path, f"{where}.second", finding.get("second"), w)
    buffer = finding.get("buffer")
    if not isinstance(buffer, str) or not buffer:
        raise _at(path, f"{where}.buffer", f"must name a buffer, got {buffer!r}")
    returned = tuple(finding[side].get("returned", False) for side in ("first", "second"))
    match = _checker_finding(schedule_path, w, finding.get("class"), buffer, first, second,
                             returned)
    if match is None:
        raise ReplayError(
            f"--replay {path}: the race of {where} ({finding.get('class')} on {buffer} "
            f"between {first[2]} on rank {first[0]} (call {first[1]}) and {second[2]} on rank "
            f"{second[0]} (call {second[1]}), W={w}) does not apply to {schedule_path}: "
            f"`dcpc check {schedule_path} --world {w}` finds no such race there")
    held, other, at = first, second, "after" if match.first.returned else "before"
    unforced = ""
    if match.second.returned and first[1] < second[1]:  # a later call's return read
        if first[0] != second[0]:  # after the earlier call's write (the docstring)
            held, other, at = second, first, "after"
        else:
            unforced = (f"{second[2]} of call {second[1]} returns and is compared on rank "
                        f"{second[0]} before that rank runs {first[2]} of call {first[1]} "
                        "(one step at a time), so a replay cannot land the stale write "
                        "before that comparison; only a later read of the buffer shows it")
    owner = (match.second if held is second else match.first).owner
    watch = buffer if other[3] == "write" and owner == held[0] else None
    return Replay(hold=held[:3], release=other[:3], watch=watch, text=match.message,
                  world=w, calls=max(first[1], second[1]) + 1, at=at, unforced=unforced)


def _checker_finding(schedule_path: str, world: int, cls: Any, buffer: str,
                     first: tuple[int, int, str, str], second: tuple[int, int, str, str],
                     returned: tuple[bool, bool]) -> Any:
    """The checker's own finding of this race in the schedule at ``world``, or None."""
    from dcpc.diagnostics import DiagnosticError
    from dcpc.pipeline import Options, run

    try:
        run(schedule_path, Options(worlds=[world]), until="hb")
    except DiagnosticError as err:
        report = getattr(getattr(err, "compilation", None), "hb_report", None)
        if report is None:
            raise  # the schedule does not compile: its own diagnostics say why
        for f in report.findings:
            if f.kind != "race" or f.second is None:
                continue
            sides = ((f.first.rank, f.first.call, f.first.step, f.first.access),
                     (f.second.rank, f.second.call, f.second.step, f.second.access))
            if ((f.cls, f.buffer) == (cls, buffer) and sides == (first, second)
                    and (f.first.returned, f.second.returned) == returned):
                return f
    return None
