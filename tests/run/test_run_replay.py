"""Issue 33 item 6: ``dcpc run`` finds the races the checker names.

The default calls cover slot reuse (call c and call c + slots both run), and
``dcpc run --replay FILE`` makes the race of a ``dcpc check --format json``
counterexample happen: the rank of the race's first access is held before that step
until the other access has happened (an ordering wait: the raced instance no longer
holds what the read should see, or the other step's rank says it ran), so the run
shows the wrong data.
Real ranks (host backend: processes over shared memory) for the runs; the refusals run
in process with a launcher that fails the test if a rank starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.schedules import CHAIN_RACE, GATHER_NO_BARRIER

from dcpc import demo
from dcpc.harness.replay import MAX_REPLAY_BYTES
from dcpc.harness.run import RunConfig, run_schedule
from dcpc.run_limits import MAX_CALLS

ROOT = Path(__file__).resolve().parents[2]
WRONG = ROOT / "tests" / "hb_corpus" / "barrier_before_consumer.yaml"  # WAR on q_full
FIXED = ROOT / "tests" / "hb_corpus" / "barrier_before_consumer.fixed.yaml"
DEADLOCK = ROOT / "tests" / "hb_corpus" / "ring_wait_before_signal.yaml"


def dcpc(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dcpc", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ})


def counterexample(schedule: Path, out: Path) -> Path:
    """What ``dcpc check --format json`` writes for ``schedule`` (exit 1: refused)."""
    done = dcpc("check", str(schedule), "--format", "json", timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    out.write_text(done.stdout)
    return out


def test_default_calls_reach_every_slot_s_next_user(tmp_path: Path) -> None:
    """Without --calls, a schedule of 12 slots runs 2 x 12 + 1 = 25 calls (the fixed 20
    before: calls 20..23 of slots 9..0's second users never ran); --help says so."""
    many = tmp_path / "twelve_slots.yaml"
    many.write_text(FIXED.read_text().replace("slots: 1", "slots: 12"))
    record = tmp_path / "run.json"
    done = dcpc("run", str(many), "--jitter-ms", "0", "--json", str(record))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "25 calls" in done.stdout, done.stdout
    assert json.loads(record.read_text())[0]["calls"] == 25
    assert "2 x slots + 1" in " ".join(dcpc("run", "--help", timeout=120).stdout.split())


def test_replay_makes_the_checker_s_race_happen(tmp_path: Path) -> None:
    """barrier_before_consumer: attention on rank 0 (call 0) reads q_full while rank 1's
    query_gather of call 1 may write it. Held until that write lands, rank 0 reads call
    1's block: q_full mismatches the float64 reference, on every run (a plain run caught
    it in 1 of 5 seeds when measured)."""
    found = counterexample(WRONG, tmp_path / "race.json")
    record = tmp_path / "run.json"
    # a long wait: the hold lasts at most half of it, and a loaded machine is slow
    done = dcpc("run", str(WRONG), "--replay", str(found), "--wait-timeout", "240",
                "--calls", "2", "--json", str(record))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "released when q_full was written" in done.stdout, done.stdout
    result = json.loads(record.read_text())[0]
    assert result["outputs"]["q_full@attention"]["mismatches"] >= 1, result
    assert result["outputs"]["q_full@attention"]["first"].startswith(
        "call 0 slot 0 rank 0 (attention reads): q_full"), result
    assert result["replay"]["hold"] == [0, 0, "attention"]
    assert result["replay"]["until"] == [1, 1, "query_gather"]


def test_replay_of_a_returned_read_holds_after_the_return(tmp_path: Path) -> None:
    """The race is the engine's read of what gather on rank 0 (call 0) returned against
    rank 1's gather of call 1 pushing its block into rank 0's g: rank 0 is held after
    its gather returned, before the harness compares what it returned, until rank 1's
    push landed; the comparison sees rank 1's call-1 block (columns D..2D-1 of g), on
    every run, with no load."""
    schedule = tmp_path / "gather_no_barrier.yaml"
    schedule.write_text(GATHER_NO_BARRIER)
    found = counterexample(schedule, tmp_path / "race.json")
    (finding,) = json.loads(found.read_text())["results"][0]["hb"]["findings"]
    assert finding["first"]["returned"] is True and "returned" not in finding["second"]
    assert "the engine still reads what gather on rank 0 (call 0) returned" in finding["message"]
    record = tmp_path / "run.json"
    done = dcpc("run", str(schedule), "--world", "2", "--calls", "2", "--replay", str(found),
                "--wait-timeout", "240", "--json", str(record))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert ("gather on rank 0 (call 0) held after its return until gather on rank 1 (call 1) "
            "ran: released when g was written") in done.stdout, done.stdout
    assert "NOT FORCED" not in done.stdout and "FAILED" in done.stdout, done.stdout
    result = json.loads(record.read_text())[0]
    assert result["replay"]["hold"] == [0, 0, "gather"] and result["replay"]["at"] == "after"
    assert result["outputs"]["y"]["mismatches"] == 0, result
    g = result["outputs"]["g"]
    assert g["mismatches"] >= 1, result
    # the first wrong element is in rank 1's block (columns 16..31) of the call-0 row 0:
    # rank 1's call-1 row, pushed before rank 0's gather of call 0 was read
    assert re.match(r"call 0 slot 0 rank 0 \(gather\): g\[0, (1[6-9]|2\d|3[01])\] ",
                    g["first"]), result


def test_replay_of_a_later_call_s_returned_read_forces_the_stale_write(tmp_path: Path) -> None:
    """Two calls in flight sharing g (slots: 2, streams: per_slot, shared: true): the race
    is the engine's read of what gather on rank 0 (call 1) returned before rank 1's gather
    of call 0 finished writing rank 0's g. The read harms only once that earlier write
    lands late, after call 1's own and before the comparison (review M1 of issue 33
    flaky23: the writer held before its step said "released" and the run was OK): the
    reader is held after its return until the stale write landed, call 1's gather run
    first; the comparison of call 1 sees call 0's block."""
    schedule = tmp_path / "gather_shared.yaml"
    schedule.write_text(GATHER_NO_BARRIER.replace("slots: 1", "slots: 2\nstreams: per_slot")
                        .replace("symmetric: true}", "symmetric: true, shared: true}"))
    found = counterexample(schedule, tmp_path / "race.json")
    finding = json.loads(found.read_text())["results"][0]["hb"]["findings"][0]
    assert finding["class"] == "read-after-write" and finding["second"]["returned"] is True
    assert (finding["first"]["call"], finding["second"]["call"]) == (0, 1), finding
    record = tmp_path / "run.json"
    done = dcpc("run", str(schedule), "--world", "2", "--calls", "2", "--replay", str(found),
                "--wait-timeout", "240", "--json", str(record))
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("gather on rank 0 (call 1) held after its return until gather on rank 1 (call 0) "
            "ran: released when g was written") in done.stdout, done.stdout
    assert "NOT FORCED" not in done.stdout and "FAILED" in done.stdout, done.stdout
    result = json.loads(record.read_text())[0]
    assert result["replay"]["hold"] == [0, 1, "gather"] and result["replay"]["at"] == "after"
    g = result["outputs"]["g"]
    assert g["mismatches"] >= 1, result
    # rank 1's block (columns 16..31) of call 1 on rank 0: call 0's, landed late
    assert re.match(r"call 1 slot \d rank 0 \(gather\): g\[\d+, (1[6-9]|2\d|3[01])\] ",
                    g["first"]), result


def test_replay_on_the_fixed_twin_says_the_race_does_not_apply(no_ranks, capsys,
                                                                tmp_path: Path) -> None:
    found = counterexample(WRONG, tmp_path / "race.json")
    assert demo.main([str(FIXED), "--replay", str(found)]) == 2
    err = capsys.readouterr().err
    assert "does not apply to" in err and "finds no such race there" in err, err
    assert "write-after-read on q_full between attention on rank 0 (call 0)" in err, err
    assert "Traceback" not in err


def _race(tmp_path: Path) -> dict:
    return json.loads(counterexample(WRONG, tmp_path / "race.json").read_text())


def _edit(data: dict, **first: object) -> dict:
    finding = data["results"][0]["hb"]["findings"][0]
    finding["first"].update(first)
    return data


@pytest.mark.parametrize("content, words", [
    (None, "cannot read it (FileNotFoundError"),
    ("huge", f"{MAX_REPLAY_BYTES + 1} bytes, more than a counterexample takes"),
    ('{"results": [\n', ":2:1: not JSON (Expecting value)"),
    ("[" * 100_000, "nested too deeply"),
    ('{"results": 3}', "results: is not a list"),
    ("[1, 2]", "(top level): is not a counterexample"),
    ("deadlock", "holds no race to replay (only: deadlock"),
    ({"rank": 9}, "findings[0].first.rank: 9 is not a rank of W=2 (0..1)"),
    ({"rank": True}, "findings[0].first.rank: must be an integer, got True"),
    ({"call": 10**30}, f"findings[0].first.call: {10**30} is not in 0..{MAX_CALLS - 1}"),
    ({"call": -1}, "findings[0].first.call: -1 is not in"),
    ({"step": ""}, "findings[0].first.step: must name a step"),
    ({"access": "peek"}, "findings[0].first.access: must be read or write"),
    ({"step": "nowhere"}, "does not apply to"),
    ({"returned": "yes"}, "findings[0].first.returned: must be true on a read"),
    ({"returned": True}, "does not apply to"),  # attention's own read, not its return
    ({"returned": False}, "findings[0].first.returned: must be true on a read"),  # unwritten
    ({"world": 99}, "findings[0].world: '99': group sizes must lie in 2..64 here, got 99"),
    ({"world": [2]}, "findings[0].world: must be a group size (W or a mesh shape"),
])
def test_a_bad_replay_file_is_a_located_usage_error(no_ranks, capsys, tmp_path: Path,
                                                    content: object, words: str) -> None:
    path = tmp_path / "replay.json"
    if content == "huge":  # sparse: no disk is written
        with open(path, "wb") as f:
            f.truncate(MAX_REPLAY_BYTES + 1)
        content = None
    elif content == "deadlock":  # a schedule the checker refuses with a deadlock only
        content = counterexample(DEADLOCK, tmp_path / "dead.json").read_text()
    elif isinstance(content, dict):
        data = _race(tmp_path)
        if "world" in content:
            data["results"][0]["hb"]["findings"][0]["world"] = content["world"]
        else:
            data = _edit(data, **content)
        content = json.dumps(data)
    if content is not None:
        path.write_text(str(content))
    assert demo.main([str(WRONG), "--replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert f"--replay {path}" in err, err


@pytest.mark.parametrize("args, words", [
    (["--world", "3"], "the race was found at W=2, the run asks --world 3"),
    (["--calls", "1"], "--calls 1: the replayed race is in call 1; give at least 2 calls"),
])
def test_replay_options_that_cannot_show_the_race_are_refused(no_ranks, capsys, tmp_path,
                                                              args: list[str],
                                                              words: str) -> None:
    found = counterexample(WRONG, tmp_path / "race.json")
    assert demo.main([str(WRONG), "--replay", str(found), *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_replay_of_two_calls_in_flight_interleaves_them(tmp_path: Path) -> None:
    """shared_scratch_local: with two slots on their own streams, pre of call 1 may write
    the shared scratch while attention of call 0 on the same rank still reads it. One
    rank runs its events in one order, so a hold alone could never release (it ran to
    its bound, unforced): the replay interleaves calls 0 and 1 with pre of call 1 first,
    and attention of call 0 reads call 1's scratch."""
    schedule = ROOT / "tests" / "hb_corpus" / "shared_scratch_local.yaml"
    found = counterexample(schedule, tmp_path / "race.json")
    record = tmp_path / "run.json"
    done = dcpc("run", str(schedule), "--replay", str(found), "--wait-timeout", "240",
                "--calls", "2", "--json", str(record))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "slot order interleaved" in done.stdout, done.stdout
    result = json.loads(record.read_text())[0]
    assert result["replay"]["outcome"].startswith("released"), result
    assert result["outputs"]["scratch"]["first"].startswith(
        "call 0 slot 1 rank 0 (attention reads): scratch"), result


def test_replay_releases_when_the_write_landed_before_the_hold(tmp_path: Path) -> None:
    """Rank 0 paused before attention (a fault): rank 1's gather of call 1 lands in
    q_full before rank 0's hold begins. The hold compares the instance with what
    attention should read (the reference), so it lets go at once; a hold that waited
    for the bytes to change from where the hold began waited to its bound, unforced."""
    from dcpc.harness.replay import plan

    found = counterexample(WRONG, tmp_path / "race.json")
    report = run_schedule(RunConfig(
        schedule=str(WRONG), world=2, backend="host", calls=2, wait_timeout_s=240,
        replay=plan(str(found), str(WRONG), None),
        fault={"rank": 0, "call": 0, "step": "attention", "kind": "pause", "seconds": 10}))
    assert report.replay_outcome.startswith("released when q_full was written"), \
        report.replay_outcome
    assert report.outputs["q_full@attention"].mismatches >= 1


def test_a_replay_a_per_step_hold_cannot_force_says_so(tmp_path: Path) -> None:
    """implicit_via_reuse: out_scatter of call 0 reads the via that a peer's out_scatter
    of call 1 writes, inside one kernel step. No hold before a step orders that; the
    hold ends at its bound (half of --wait-timeout) and the result says the race was
    not shown (before: a peer's store of the same call changed the via and the hold
    reported itself released, and the run said OK as if the race had been tried)."""
    schedule = ROOT / "tests" / "hb_corpus" / "implicit_via_reuse.yaml"
    found = counterexample(schedule, tmp_path / "race.json")
    done = dcpc("run", str(schedule), "--replay", str(found), "--wait-timeout", "10",
                "--calls", "2")
    assert "NOT FORCED: nothing happened within 5 s of holding" in done.stdout, done.stdout
    assert "the replay's order was not forced, so this run does not show its race" in \
        done.stdout, done.stdout


def test_replay_of_a_mesh_race_runs_on_its_shape(tmp_path: Path) -> None:
    """A mesh counterexample names its shape ("world": "2x2"; it was 4, which dcpc run
    refused for a two-axis mesh, 'give a shape such as 2x2'), and the replay runs it.
    Its first race: the engine's read of what gather_in_node of call 1 returned on rank
    (0, 0) before rank (0, 1)'s push of call 0 into the shared q_node (a read-after-write
    whose read is the returned one of a later call: the reader is held after its return
    until call 0's push landed, call 1's gather_in_node run first). Call 0's push lands on
    top of call 1's block before the return is compared, and gather_nodes of call 1
    sends call 0's heads on."""
    schedule = ROOT / "tests" / "gallery_twins" / "hierarchical_two_level.shared_hand_off.yaml"
    found = counterexample(schedule, tmp_path / "race.json")
    assert json.loads(found.read_text())["results"][0]["hb"]["findings"][0]["world"] == "2x2"
    record = tmp_path / "run.json"
    done = dcpc("run", str(schedule), "--replay", str(found), "--wait-timeout", "240",
                "--calls", "2", "--json", str(record))
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads(record.read_text())[0]
    assert result["world"] == "2x2" and result["replay"]["outcome"].startswith("released")
    assert (result["replay"]["hold"], result["replay"]["at"]) == ([0, 1, "gather_in_node"],
                                                                  "after"), result
    assert result["outputs"]["q_node"]["first"].startswith(
        "call 1 slot 0 rank 0 (gather_in_node): q_node"), result
    assert result["outputs"]["q_full"]["first"].startswith(
        "call 1 slot 0 rank 0 (gather_nodes): q_full"), result


PHANTOM = """\
schedule: p
sizes: {N: 4, D: 40}
buffers:
  x: {shape: [N, D], dtype: f32}
  y: {shape: [N, D], dtype: f32}
  s: {shape: [N, D], dtype: f32, symmetric: true}
steps:
  - swap: {op: shift, src: x, dst: s, perm: "r + 1 - 2 * (r % 2)"}
  - use: {op: external, when: "rank < 2", reads: [s], writes: [y]}
  - credit: {op: signal, to: next, channel: free}
  - freed: {op: wait, from: prev, channel: free}
"""


def replayed(tmp_path: Path, text: str, world: str,
             *run: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """``text`` checked at ``world`` (refused: exit 1), then run two calls with ``run``'s
    options and ``--replay`` of its counterexample (refused too): the run and its record."""
    schedule = tmp_path / "s.yaml"
    schedule.write_text(text)
    done = dcpc("check", str(schedule), "--world", world, "--format", "json", timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    found = tmp_path / "race.json"
    found.write_text(done.stdout)
    record = tmp_path / "run.json"
    done = dcpc("run", str(schedule), *run, "--calls", "2", "--replay", str(found),
                "--wait-timeout", "240", "--json", str(record))
    assert done.returncode == 1, done.stdout + done.stderr
    return done, json.loads(record.read_text())[0]


def test_replay_of_a_perm_race_holds_ranks_the_table_joins(tmp_path: Path) -> None:
    """At W=3 the swap's table is [1, 0, -1]; the race the checker finds on rank 0's s
    comes from a phantom writer (rank 2, which sends nothing). Its counterexample named
    that store, so the replay held rank 0 for rank 2's swap, which never writes s: the
    run matched (0 mismatches). Shown at a store the table makes (rank 0 into rank 1),
    the replay makes the race happen: its first race is now the engine's read of what
    swap on rank 1 (call 0) returned, held after that return until rank 0's swap of
    call 1 stored into s."""
    _, result = replayed(tmp_path, PHANTOM, "3")
    assert (result["replay"]["hold"], result["replay"]["at"]) == ([1, 0, "swap"], "after"), \
        result["replay"]
    assert result["replay"]["until"] == [0, 1, "swap"], result["replay"]
    assert result["replay"]["outcome"].startswith("released"), result["replay"]
    assert result["outputs"]["s"]["first"].startswith("call 0 slot 0 rank 1 (swap): s"), result


def test_replay_of_a_race_after_a_guarded_chain_forces_it(tmp_path: Path) -> None:
    """A chain of waits the when: guards cut (support.schedules.CHAIN_RACE: rank 0 waits
    for rank 1, which skips the wait) with a shift no credit frees: the checker once
    refused it (guarded-cycle, no timeline); its race is now found on the ranks' real
    steps (races.find_real_races), and its counterexample holds rank 0 after its put
    returned until rank 1's put of call 1 wrote s: what rank 0's engine reads is wrong."""
    done, result = replayed(tmp_path, CHAIN_RACE, "2", "--world", "2")
    assert "NOT FORCED" not in done.stdout and "FAILED" in done.stdout, done.stdout
    assert result["replay"]["hold"] == [0, 0, "put"], result["replay"]
    assert result["replay"]["until"] == [1, 1, "put"], result["replay"]
    assert result["replay"]["outcome"].startswith("released"), result["replay"]
    assert result["outputs"]["s"]["mismatches"] >= 1, result


def test_a_later_call_s_return_read_on_the_writer_s_own_rank_says_it_is_not_forced(
        tmp_path: Path) -> None:
    """custom_all_reduce_two_shot.shared_tmp: the engine's read of what reduce_part of call
    1 returned on rank 0 against rank 0's own reduce_part of call 0. One rank runs one step
    at a time: its call-1 return is compared before it can run call 0's step, so no hold
    lands the stale write before that comparison. The writer is held before its step (the
    stale write lands after call 1's own, where gather reads it: the gallery replay test)
    and the replay says the race's own read is NOT FORCED, and why."""
    from dcpc.harness.replay import plan

    twin = ROOT / "tests" / "gallery_twins" / "custom_all_reduce_two_shot.shared_tmp.yaml"
    replay = plan(str(counterexample(twin, tmp_path / "race.json")), str(twin), None)
    assert (replay.hold, replay.release, replay.at) == ((0, 0, "reduce_part"),
                                                        (0, 1, "reduce_part"), "before")
    assert "one step at a time" in replay.unforced, replay


# ---- the hold's own report: which release it names --------------------------------------
def _hold(tmp_path: Path, flag: bool, written: bool, hold_s: float = 60.0) -> str:
    from dcpc.harness.adversary import replay_hold

    replay = {"flag": str(tmp_path / "released"), "watch": "s", "hold_s": hold_s}
    if flag:
        (tmp_path / "released").touch()
    return replay_hold(replay, lambda: written)


def test_a_write_that_landed_with_the_flag_is_named_as_the_write(tmp_path: Path) -> None:
    """The other rank raises the flag after its step wrote: when the held rank first looks
    after both (one poll saw neither, the next sees both), the hold names the write, not
    the flag (it named the flag: the guarded credit race's replay test failed about one run
    in ten, its race shown but its release line not)."""
    assert _hold(tmp_path, flag=True, written=True).startswith("released when s was written")


def test_a_flag_with_nothing_written_is_named_as_the_flag(tmp_path: Path) -> None:
    assert _hold(tmp_path, flag=True, written=False).startswith(
        "released by the other access's step")


def test_a_hold_nothing_ends_says_not_forced(tmp_path: Path) -> None:
    assert _hold(tmp_path, flag=False, written=False, hold_s=0.05).startswith("NOT FORCED")
