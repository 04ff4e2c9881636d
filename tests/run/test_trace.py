"""The access tracer (dcpc.harness.trace): every load, store and atomic of the emitted
kernels, run for real under the Triton interpreter (backend ``local``: every rank a
thread of this process), agrees with the plan's effects, for every shipped schedule and
every engine schedule of tests/engine_schedules, at one program per kernel and at
several (per-program tiling: programs loop over more tiles than they are), and at
several tile sizes. A mutated effect in the plan and a mutated template are caught.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jinja2
import numpy as np
import pytest

from dcpc.harness import trace as tr

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "schedules").glob("*.yaml")) + sorted(
    (ROOT / "tests" / "engine_schedules").glob("*.yaml"))
# (world, programs, block): one program per kernel at the default tiles; three programs
# over 256-element tiles (each program loops over several tiles); W = 3, two programs
# over 128-element tiles for the small engine schedules
CONFIGS = [(2, 1, None), (2, 3, 256)]
W3 = {"fused_local", "agrs_f32", "a2a_local_fp8"}
# ops no shipped schedule uses (signal, wait to next/prev, barrier, a shared buffer with
# an interleaved all_gather): two fixed schedules of the happens-before corpus, at W = 3
CORPUS = [ROOT / "tests" / "hb_corpus" / f"{name}.fixed.yaml"
          for name in ("ring_both_directions", "kv_gather_no_barrier")]

pytestmark = pytest.mark.e2e
FUSED_CASE = (ROOT / "schedules" / "kimi_k3_dcp_fused.yaml", 2, 1, None)
KEPT: dict[tuple, tr.TracedRun] = {}  # a case's run that a fixture below reads again

def params() -> list:
    out = []
    for path in FILES:
        configs = CONFIGS + ([(3, 2, 128)] if path.stem in W3 else [])
        for world, programs, block in configs:
            out.append(pytest.param(path, world, programs, block,
                                    id=f"{path.stem}-W{world}-P{programs}-b{block}"))
    return out + [pytest.param(path, 3, 2, 256, id=f"{path.stem}-W3-P2-b256")
                  for path in CORPUS]


@pytest.mark.parametrize("path,world,programs,block", params())
def test_kernels_touch_what_the_plan_says(path, world, programs, block):
    from dcpc.runtime.local import LocalRankError

    try:
        run = tr.run_traced(str(path), world, programs=programs, block=block, calls=2)
        if (path, world, programs, block) == FUSED_CASE:
            KEPT[FUSED_CASE] = run  # the fused fixture's run: made once
    except LocalRankError as exc:
        # KNOWN, not understood (2026-12-01): once in one clean-clone CI run, rank 1 of a
        # traced W=2 run timed out in its first query_gather (peer 0 never signalled) and
        # the same case passed alone at once. Not reproduced since (2026-12-02: ~150
        # traced runs of four schedules under a load of 8-23, the longest call 10 s of the
        # 60 s bound; reading found no race in the tracer). A second hang fails; the
        # first is retried once, printed with where each rank got to (run_traced).
        if "timed out waiting" not in str(exc):
            raise
        print(f"RETRIED after a hang under the tracer: {exc}")
        run = tr.run_traced(str(path), world, programs=programs, block=block, calls=2)
    assert run.mismatches == 0, "outputs differ from the float64 simulation"
    assert run.trace.calls and run.trace.raw
    signalling = [s.name for s in run.plan.steps if s.sync.signal and s.op != "signal"]
    ran = [run.trace.programs.get(s, 0) for s in signalling]
    assert all(p >= 1 for p in ran), f"a signalling step never launched: {ran}"
    if programs > 1:  # per-program tiling really ran: some exchange used several programs
        assert max(ran) > 1, run.trace.programs
    assert max(run.trace.programs.values()) <= max(programs, 128)
    assert run.problems == []


def _paused_failure(schedule: str, rank: int, step: str, wait_s: float) -> str:
    """The error of a traced W = 2 run of schedules/``schedule`` whose ``rank`` pauses
    before its first ``step`` for 5 s of the progress a busy thread makes now (a wall
    pause against the peer's wait of ``wait_s`` of its CPU time: scaled as that wait is)."""
    from dcpc.runtime.clock import wall_timeout
    from dcpc.runtime.local import LocalRankError

    pause = {"rank": rank, "call": 0, "step": step, "kind": "pause",
             "seconds": wall_timeout(5.0)}
    with pytest.raises(LocalRankError) as info:
        tr.run_traced(str(ROOT / "schedules" / schedule), 2, programs=1, calls=1,
                      timeout_s=wait_s, fault=pause)
    return str(info.value)


def test_a_failed_traced_run_says_where_each_rank_got_to():
    """Rank 1 pauses before its first query_gather (``_paused_failure``); rank 0's wait
    is bounded at 0.2 s: the error names every rank's last call, its launches and its
    signals, from the tracer's record (what the retry above prints)."""
    text = _paused_failure("kimi_k3_dcp_staging.yaml", 1, "query_gather", 0.2)
    assert "rank 0 timed out waiting for peer 1" in text, text
    tail = text.split("where each rank got to (the tracer's record):\n", 1)[1].splitlines()
    assert re.fullmatch(r"  rank 0: call 1 of its own \(trace call \d\): step 'query_gather' "
                        r"slot \d, [1-9]\d* launch\(es\) begun, [1-9]\d* atomic "
                        r"exchange\(s\) \(signals, flags\) made", tail[0]), text
    # each rank's signal words on the channel its last step polls (sessions 25 and 26 could
    # not tell a missed signal from a stalled peer in a failure's log)
    word = (r"    signal bank, slot \d: its programs' epochs on channel (\d+) \(step 0\) "
            r"\[1\]; the epochs in the words each peer signalled on channel \1 \(step 0\): "
            r"rank 1 \[{}\]")
    assert re.fullmatch(word.format(r"\d"), tail[1]), text
    assert tail[2].startswith("  rank 1: "), text
    # the record when rank 0 failed: rank 1 (paused) had made no call, its word still 0
    first = text.split("when the first rank failed (the tracer's record):\n", 1)[1].splitlines()
    assert re.fullmatch(word.format("0"), first[1]), text
    assert first[2] == "  rank 1: no call yet", text
    # and where rank 1's thread was then (dcpc.runtime.local): in call 0's reference or pause
    assert "when rank 0 failed, the ranks still running were at:\nrank 1 is at (call 0" in text


def test_a_failed_split_wait_shows_its_own_epochs_and_the_words_of_the_put_it_polls():
    """shift_wait_first's `receive` (phase: wait) polls `send`'s channel, while its
    programs' epochs advance on its own (templates/sync.j2). Rank 0 pauses before its
    send; rank 1's wait gives up: its record when it failed shows the epoch it waited for
    (1, on receive's channel) and rank 0's word still 0 on send's: a stalled peer, not a
    missed signal (the epochs read on the polled channel said 0, as if the word's epoch
    had arrived)."""
    text = _paused_failure("ops/shift_wait_first.yaml", 0, "send", 0.3)
    assert "step 'receive': rank 1 timed out waiting for peer 0" in text, text
    first = text.split("when the first rank failed (the tracer's record):\n", 1)[1]
    lines = first.split("where each rank got to", 1)[0].splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  rank 1: "))
    assert "step 'receive'" in lines[at], text
    bank = re.fullmatch(r"    signal bank, slot 0: its programs' epochs on channel (\d+) "
                        r"\(step 0\) \[1\]; the epochs in the words each peer signalled on "
                        r"channel (\d+) \(step 3\): rank 0 \[0\]", lines[at + 1])
    assert bank and bank[1] != bank[2], text


def test_a_wait_that_spins_long_records_its_polls_once():
    """Rank 1 pauses 1.5 s before its first query_gather, so rank 0's wait polls the same
    words for that long: each address set is recorded once per call and phase (before,
    every poll was appended: a traced run with a slow peer grew one CI worker to 23 GB),
    and the run still matches float64 with the plan's effects."""
    staging = ROOT / "schedules" / "kimi_k3_dcp_staging.yaml"
    pause = {"rank": 1, "call": 0, "step": "query_gather", "kind": "pause", "seconds": 1.5}
    run = tr.run_traced(str(staging), 2, programs=1, calls=1, fault=pause)
    assert run.mismatches == 0 and run.problems == []
    for key, parts in run.trace.raw.items():
        assert len({a.tobytes() for a in parts}) == len(parts), key


# ---- mutations: the tracer must catch a wrong table row and a wrong template -----------
SCHEDULE = ROOT / "tests" / "engine_schedules" / "agrs_f32.yaml"


@pytest.fixture(scope="module")
def agrs() -> tr.TracedRun:
    run = tr.run_traced(str(SCHEDULE), 2, programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == []
    return run


def mutated(run: tr.TracedRun, step: str, change) -> list[str]:
    """The same trace checked against a plan whose ``step`` effects are ``change``d."""
    plan = dataclasses.replace(run.plan, steps=[
        dataclasses.replace(s, effects=change(list(s.effects))) if s.name == step else s
        for s in run.plan.steps])
    return tr.check(run.trace, plan, 2)


def test_a_dropped_read_is_caught(agrs):
    problems = mutated(agrs, "correct", lambda es: [e for e in es if e.buffer != "lse_all"])
    assert any("reads 'lse_all' before its signal/wait; the plan says: nothing" in p
               for p in problems), problems


def test_a_read_moved_after_the_wait_is_caught(agrs):
    def late(es):
        return [dataclasses.replace(e, when="after") if e.buffer == "o_corr" else e for e in es]

    problems = mutated(agrs, "out_scatter", late)
    assert any("reads 'o_corr' before its signal/wait; the plan says: read after" in p
               for p in problems), problems
    assert any("the plan says it reads 'o_corr' after its signal/wait; no kernel did" in p
               for p in problems), problems


def test_a_remote_write_without_its_region_is_caught(agrs):
    def no_region(es):
        return [dataclasses.replace(e, region=None) if e.region else e for e in es]

    problems = mutated(agrs, "lse_gather", no_region)
    assert any("writes rank 1's instance of 'lse_all', but its effect has no region" in p
               for p in problems), problems


def test_a_wrong_region_is_caught(agrs):
    def other_dim(es):
        return [dataclasses.replace(e, region=dataclasses.replace(e.region, dim=1))
                if e.region else e for e in es]

    problems = mutated(agrs, "lse_gather", other_dim)
    assert any("writes 'lse_all' of rank" in p and "outside rank" in p for p in problems), problems


def test_an_effect_no_kernel_has_is_caught(agrs):
    def extra(es):
        return es + [dataclasses.replace(es[0], buffer="scale", kind="read", when="before")]

    problems = mutated(agrs, "lse_gather", extra)
    assert problems == ["step 'lse_gather': the plan says it reads 'scale' before its "
                        "signal/wait; no kernel did, on any rank"]


def test_an_access_outside_every_buffer_is_caught(agrs):
    """A load from an address no buffer of any rank holds (here: address 8)."""
    key = (0, "before", "read")
    raw = {**agrs.trace.raw, key: agrs.trace.raw.get(key, []) + [np.array([8], np.uint64)]}
    stray = tr.Trace(calls=agrs.trace.calls, ranges=agrs.trace.ranges, raw=raw)
    problems = tr.check(stray, agrs.plan, 2)
    assert problems == [f"step '{agrs.trace.calls[0].step}' (rank {agrs.trace.calls[0].rank}, "
                        f"slot {agrs.trace.calls[0].slot}, call 0): read outside every buffer "
                        "(0x8...)"], problems


def render_variant(monkeypatch, name: str, edit) -> None:
    """Emit with template ``name`` replaced by ``edit(its text)``."""
    from dcpc.codegen import emit

    text = (emit.template_dir() / name).read_text()
    variant = edit(text)
    assert variant != text
    env = emit._env()
    patched = env.overlay(loader=jinja2.ChoiceLoader(
        [jinja2.DictLoader({name: variant}), env.loader]))
    monkeypatch.setattr(emit, "_env", lambda: patched)


def once(old: str, new: str):
    def edit(text: str) -> str:
        assert text.count(old) == 1, old
        return text.replace(old, new)

    return edit


def test_a_template_that_pushes_after_its_wait_is_caught(monkeypatch):
    """reduce_scatter rendered with its signal/wait before the push: it reads src and
    writes the peers' receive buffers after its wait, where the plan says before."""
    exchange = "{{ sync.exchange(pushes, sums, step=step) | chomp }}\n"
    prologue = "{{ sync.prologue(step=step, signal=pushes, wait=sums) | chomp }}\n"
    render_variant(monkeypatch, "ops/reduce_scatter.py.j2", lambda text: once(
        prologue, prologue + exchange)(once(exchange, "")(text)))
    run = tr.run_traced(str(SCHEDULE), 2, programs=2, block=256, calls=1)
    assert any("step 'out_scatter'" in p and "reads 'o_corr' after its signal/wait; the plan "
               "says: read before" in p for p in run.problems), run.problems
    assert any("writes 'out_scatter_recv' after its signal/wait; the plan says: write before"
               in p for p in run.problems), run.problems


def test_a_template_that_pushes_into_another_part_is_caught(monkeypatch):
    """all_gather rendered to store into the next rank's part of every peer's dst."""
    render_variant(monkeypatch, "ops/all_gather.py.j2", once(
        "d += RANK * interleave{{ p }} + j % interleave{{ p }}",
        "d += ((RANK + 1) % WORLD) * interleave{{ p }} + j % interleave{{ p }}"))
    run = tr.run_traced(str(SCHEDULE), 2, programs=2, block=256, calls=1)
    assert run.mismatches > 0  # the data is wrong too, and the tracer says where
    assert any("step 'lse_gather'" in p and "writes 'lse_all' of rank" in p
               and "outside rank" in p for p in run.problems), run.problems


def test_a_template_that_pushes_past_the_line_s_end_is_caught(monkeypatch):
    """shift with wrap: false rendered to push on every rank, cyclically: the last rank
    stores into rank 0's recv, which no rank + offset reaches on a line (Region.target)."""
    cond = "0 <= self.rank + {{ step.attrs.offset }} < self.world"
    render_variant(monkeypatch, "ops/shift.py.j2", lambda text: once(
        f"_rows if {cond} else 0,", "_rows,")(once(
            f"TO=(self.rank + {{{{ step.attrs.offset }}}} if {cond} else self.rank),",
            "TO=(self.rank + {{ step.attrs.offset }}) % self.world,")(text)))
    run = tr.run_traced(str(ROOT / "schedules" / "ops" / "shift_nowrap.yaml"), 2, programs=1,
                        calls=1)
    assert any(p.startswith("step 'hand' (rank 1, ") and "writes 'recv' of rank 0 outside "
               "rank 1's part (line, dim" in p for p in run.problems), run.problems


# ---- the fused combine's masks: looked up before the push in a call of one launch, in
# the merge launch after the wait in a call of two; its row lists both phases, `either`
MASK = "query_start_loc"


@pytest.fixture(scope="module")
def fused() -> tr.TracedRun:
    """kimi_k3_dcp_fused at one program per kernel (its case above, when it ran): its
    combine calls run both ways."""
    run = KEPT.pop(FUSED_CASE, None) or tr.run_traced(str(FUSED_CASE[0]), 2, programs=1,
                                                       calls=2)
    assert run.mismatches == 0 and run.problems == []
    return run


def mask_phases(run: tr.TracedRun) -> set[str]:
    """The phases in which the combine's kernels read query_start_loc, on any rank."""
    return {phase for (cid, phase, kind, buffer, _, _) in run.trace.accesses()
            if buffer == MASK and kind == "read" and run.trace.calls[cid].step == "combine"}


def only(when: str | None):
    """The combine's mask effects kept in phase ``when`` alone (None: dropped), plain."""
    def change(es):
        keep = [e for e in es if not e.either]
        return keep + [dataclasses.replace(e, either=False) for e in es
                       if e.either and e.when == when]

    return change


def test_the_combine_reads_its_masks_in_both_phases(fused):
    assert mask_phases(fused) == {"before", "after"}
    combine = next(s for s in fused.plan.steps if s.name == "combine")
    row = [e for e in combine.effects if e.buffer == MASK]
    assert sorted(e.when for e in row) == ["after", "before"] and all(e.either for e in row)


def test_a_mask_row_after_the_wait_alone_is_caught(fused):
    """The row before 'either': the one-launch calls' lookup before the push is caught."""
    problems = mutated(fused, "combine", only("after"))
    assert any(f"reads '{MASK}' before its signal/wait; the plan says: read after" in p
               for p in problems), problems


def test_a_mask_row_before_the_signal_alone_is_caught(fused):
    problems = mutated(fused, "combine", only("before"))
    assert any(f"reads '{MASK}' after its signal/wait; the plan says: read before" in p
               for p in problems), problems


def test_a_dropped_mask_read_is_caught(fused):
    problems = mutated(fused, "combine", only(None))
    assert any(f"reads '{MASK}' before its signal/wait; the plan says: nothing" in p
               for p in problems), problems


def test_an_either_read_no_kernel_makes_is_caught(fused):
    """An `either` pair is satisfied by one phase, never by none (said once)."""
    def extra(es):
        pair = [e for e in es if e.either and e.buffer == MASK]
        return es + [dataclasses.replace(e, buffer="q_local", key="") for e in pair]

    problems = mutated(fused, "combine", extra)
    assert problems == ["step 'combine': the plan says it reads 'q_local' before or after "
                        "its signal/wait; no kernel did, on any rank"], problems


def test_a_template_that_reads_the_masks_after_the_wait_is_rightly_not_caught(monkeypatch):
    """all_to_all_combine rendered to look its masks up after the exchange in one launch
    too: the row allows either phase, so the tracer accepts it (the data stays right),
    and it sees the move: the same trace against a row of `before` alone is caught."""
    text = (ROOT / "templates" / "ops" / "all_to_all_combine.py.j2").read_text()
    start = text.index("    if PUSH and MERGE:  # one launch")
    lookup = text[start:text.index("    if PUSH:\n", start)]
    merge = "    if PUSH and MERGE:\n        _dcpc_merge_masked("
    render_variant(monkeypatch, "ops/all_to_all_combine.py.j2",
                   lambda t: once(merge, lookup + merge)(once(lookup, "")(t)))
    run = tr.run_traced(str(ROOT / "tests" / "engine_schedules" / "fused_local.yaml"), 2,
                        programs=1, calls=1)
    assert run.mismatches == 0 and run.problems == []
    assert mask_phases(run) == {"after"}
    assert any(f"reads '{MASK}' after its signal/wait; the plan says: read before" in p
               for p in mutated(run, "combine", only("before"))), run.problems


# ---- teams: the mesh files, where a writer's part is its member index of its team ------
MESH_FILES = sorted((ROOT / "schedules" / "ops").glob("*_axis.yaml")) + [
    ROOT / "schedules" / "gallery" / f"{name}.yaml"
    for name in ("usp", "double_ring", "hierarchical_two_level")]


@pytest.mark.parametrize("path", MESH_FILES, ids=lambda p: p.stem)
def test_team_kernels_touch_their_team_s_part(path):
    """At 2x3 (teams of 2 and of 3): the tracer once took a team store's writer as its
    global rank and its part as one of W (every team file "outside rank r's part"), and
    read the team pointer tables, made at the first call, as outside every buffer."""
    from dcpc.lang.mesh import MeshWorld

    run = tr.run_traced(str(path), MeshWorld((2, 3)), programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems


# the grouped ragged files off a team: a grouped dispatch's slots (block `rank` of dst's
# dim 1), its casts, and the split combine (a grouped put and its wait)
GROUPED_FILES = [ROOT / "schedules" / "ops" / f"ragged_all_to_all_{name}.yaml"
                 for name in ("groups", "groups_cast")]


@pytest.mark.parametrize("path", GROUPED_FILES, ids=lambda p: p.stem)
def test_grouped_ragged_kernels_touch_their_slots(path):
    """At W = 3 (L = 2 groups): every grouped store lands in the part the plan says."""
    run = tr.run_traced(str(path), 3, programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems


def test_a_team_store_into_another_team_is_caught():
    """The same trace against a plan whose gather over gpu says it is over node."""
    from dcpc.lang.mesh import MeshWorld

    world = MeshWorld((2, 2))
    run = tr.run_traced(str(ROOT / "schedules" / "ops" / "all_gather_axis.yaml"), world,
                        programs=1, block=None, calls=1)
    assert run.problems == []
    axes = {s.name: next(e.region.axes for e in s.effects if e.region is not None)
            for s in run.plan.steps if any(e.region is not None for e in s.effects)}
    first, other = next((a, b) for a in axes for b in axes if axes[a] != axes[b])
    plan = dataclasses.replace(run.plan, steps=[
        dataclasses.replace(s, effects=[dataclasses.replace(
            e, region=dataclasses.replace(e.region, axes=axes[other])) if e.region else e
            for e in s.effects]) if s.name == first else s for s in run.plan.steps])
    problems = tr.check(run.trace, plan, world)
    assert any(f"step '{first}'" in p and "outside rank" in p for p in problems), problems
