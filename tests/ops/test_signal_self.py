"""A rank's own credit: ``signal`` with ``to: self`` and ``wait`` with ``from: self``
(dcpc/ops/sync.py; the rank's own flag). The conformance file is proved and its wrong
twin (the own head not opened) is the deadlock; the k-th self wait polls the k-th self
signal whichever comes first; the checker, the brute force and the execution oracle
agree; bad input gets its class; the emitted lane is the rank's own slot; the file
runs against float64 (host in tests/ops/test_op_schedules.py, torch and local here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.exec_oracle_agree import disagreements
from support.hb_oracle import assert_brute_force_agrees, unrolled
from support.schedules import diagnostics

from dcpc import pipeline
from dcpc.diagnostics import DiagnosticError
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.trace import run_traced
from dcpc.lang.mesh import MeshWorld
from dcpc.ops.common import channels
from dcpc.runtime.sync import SignalBank, channel, wrap_int32

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "schedules" / "ops" / "signal_self.yaml"
OPEN = "  - open_own: {op: signal, to: self, channel: own_head}\n"
DRAIN = "  - drain_own: {op: wait, from: self, channel: own_head}\n"

# a push into kv_recv and its read come before STEPS (8 lines: STEPS start at line 9)
HEAD = ("schedule: credit\nslots: 2\nsizes: {T: 4, D: 8}\nbuffers:\n"
        "  kv: {shape: [T, D], dtype: f32}\n"
        "  kv_recv: {shape: [T, D], dtype: f32, symmetric: true}\n"
        "  out: {shape: [T, D], dtype: f32}\nsteps:\n")


def _errors(tmp_path: Path, steps: str, worlds: list, head: str = HEAD) -> list:
    """The errors `dcpc check` gives ``steps`` at ``worlds`` ([] when proved)."""
    return [d for d in diagnostics(head + steps, tmp_path, "credit.yaml", worlds)
            if d.severity == "error"]


def _twin() -> str:
    """The conformance file without its own head's open and drain: every chunk's own
    wait then polls the free of its own chunk, written after it."""
    text = FILE.read_text()
    twin = text.replace(OPEN, "").replace(DRAIN, "")
    assert text.count(OPEN) == 1 and text.count(DRAIN) == 1
    assert twin.count("{op: signal, to: self") == 1
    return twin


def test_the_file_is_proved_and_its_wrong_twin_is_a_located_deadlock(tmp_path: Path) -> None:
    """The file at its `# check:` worlds (2..8); the twin at W = 2 and 3: a deadlock at
    the first own wait (its line), on rank 0 waiting for its own free, the cycle of
    program order named."""
    pipeline.run(FILE, pipeline.Options(worlds=list(range(2, 9))), until="hb")
    twin = _twin()
    path = tmp_path / "signal_self_wrong.yaml"
    path.write_text(twin)
    for world in (2, 3):
        with pytest.raises(DiagnosticError) as err:
            pipeline.run(path, pipeline.Options(worlds=[world]), until="hb")
        found = [d for d in err.value.diagnostics if d.severity == "error"]
        assert [d.code for d in found] == ["deadlock"], found
        line = next(i for i, x in enumerate(twin.splitlines(), 1) if "- own_credit:" in x)
        assert found[0].mark.line == line, found[0]
        assert ("own_credit_h0 on rank 0 waits for free_own_h0 of rank 0 (channel own_head)"
                in found[0].message), found[0].message
        assert f"(W={world})" in found[0].message


def test_the_kth_self_wait_polls_the_kth_self_signal() -> None:
    """The credit loop's pairing: the open for chunk 0's own wait, chunk 0's free for
    chunk 1's, chunk 1's free for the drain (no other channel's signal, no peer's)."""
    schedule = pipeline.run(FILE, pipeline.Options(worlds=[3]), until="parse").schedule
    polls = {w: s.name for w, s in channels(schedule).polls.items() if "own" in w}
    assert polls == {"own_credit_h0": "open_own", "own_credit_h1": "free_own_h0",
                     "drain_own": "free_own_h1"}


@pytest.mark.parametrize("text", [FILE.read_text(), _twin()], ids=["file", "twin"])
def test_checker_brute_force_and_execution_oracle_agree(text: str) -> None:
    """Each rank waits for itself in all three: the file clean, the twin the deadlock."""
    for world, schedule in unrolled(text, (2, 3)):
        assert_brute_force_agrees(schedule, world, text)
        assert disagreements(schedule, [world]) == [], world


def test_a_self_credit_after_its_signal_orders_nothing_program_order_does_not(
        tmp_path: Path) -> None:
    """A shift's credit sent to the rank itself does not free the writer's next push:
    the race stays (the writer is another rank); back to the writer (`offset: -1`) it is
    proved. And a self credit around a local reuse is proved, as without it."""
    push = ("  - send: {op: shift, src: kv, dst: kv_recv, offset: 1}\n"
            "  - use: {op: external, reads: [kv_recv], writes: [out]}\n")
    own = ("  - free: {op: signal, to: self, channel: f}\n"
           "  - freed: {op: wait, from: self, channel: f}\n")
    assert {d.code for d in _errors(tmp_path, push + own, [3])} == {"race"}
    back = ("  - free: {op: signal, offset: -1, channel: f}\n"
            "  - freed: {op: wait, offset: -1, channel: f}\n")
    assert _errors(tmp_path, push + back, [2, 3, 4]) == []
    local = ("  - keep: {op: copy, src: kv, dst: kv_recv}\n"
             "  - use: {op: external, reads: [kv_recv], writes: [out]}\n")
    assert _errors(tmp_path, local + own, [2, 3]) == []


@pytest.mark.parametrize(("steps", "code", "says"), [
    # a self wait with no self signal on its channel: the other forms' classes
    ("  - free: {op: signal, to: all, channel: f}\n"
     "  - freed: {op: wait, from: self, channel: f}\n",
     "peer-mismatch", "waits for 'self' peers on channel 'f', but no signal on it goes to"),
    ("  - freed: {op: wait, from: self, channel: f}\n",
     "unmatched-wait", "but no step signals it"),
    ("  - free: {op: signal, to: self, channel: f}\n"
     "  - freed: {op: wait, from: self, channel: f}\n"
     "  - again: {op: wait, from: self, channel: f}\n",
     "unmatched-wait", "wait number 2 from 'self'"),
    ("  - free: {op: signal, to: self, channel: f}\n"
     "  - freed: {op: wait, from: self, channel: f}\n"
     "  - more: {op: signal, to: self, channel: f}\n",
     "unpolled-signal", "step 'more' signals channel 'f', but no wait polls it"),
    # a self signal reaches no wait from peers, and a peers' signal no self wait
    ("  - free: {op: signal, to: self, channel: f}\n"
     "  - freed: {op: wait, from: prev, channel: f}\n",
     "peer-mismatch", "(step 'free' signals 'self' peers)"),
    # a self wait before the only self signal it can poll: the cycle on one rank
    ("  - freed: {op: wait, from: self, channel: f}\n"
     "  - free: {op: signal, to: self, channel: f}\n",
     "deadlock", "freed on every rank r waits for free of rank r itself (channel f)"),
    # `to: self` next to an offset: one way to name the peers
    ("  - free: {op: signal, to: self, offset: 2, channel: f}\n"
     "  - freed: {op: wait, offset: 2, channel: f}\n",
     "bad-offset", "both 'to' and 'offset'"),
])
def test_bad_self_credits_are_refused_with_their_class(tmp_path: Path, steps: str, code: str,
                                                      says: str) -> None:
    found = _errors(tmp_path, steps, [3])
    assert found and {d.code for d in found} == {code}, found
    assert any(says in d.message for d in found), found
    assert found[0].mark.line > 8, found[0]


def test_offset_zero_is_refused_with_a_hint_that_is_accepted(tmp_path: Path) -> None:
    """`offset: 0` keeps `bad-offset` (the rank is no peer), located at the key; the hint
    names `to: self` / `from: self`, and the file that follows it is proved."""
    steps = ("  - free: {op: signal, offset: 0, channel: f}\n"
             "  - freed: {op: wait, offset: 0, channel: f}\n")
    found = _errors(tmp_path, steps, [2, 3])
    assert [(d.code, d.mark.line) for d in found] == [("bad-offset", 9), ("bad-offset", 10)]
    assert "names offset 0" in found[0].message and "the rank itself is no peer" in \
        found[0].message
    assert "write 'to: self' instead of 'offset'" in found[0].hint
    assert "write 'from: self' instead of 'offset'" in found[1].hint
    fixed = steps.replace("signal, offset: 0", "signal, to: self").replace(
        "wait, offset: 0", "wait, from: self")
    assert _errors(tmp_path, fixed, [2, 3]) == []


def test_the_existing_meanings_of_nobody_stay(tmp_path: Path) -> None:
    """A `from: self` wait is not reached by a perm's signal; a perm's fixed point and an
    offset that is 0 mod W still signal nobody: proved, and run locally (W = 3) each
    signal's epoch lands only in its peers' banks (the perm's rank 1 and the offset 3's
    every rank: in none), and every wait returns."""
    perm = ('  - free: {op: signal, perm: "W - 1 - r", channel: f}\n'
            '  - freed: {op: wait, perm: "W - 1 - r", channel: f}\n')
    mixed = ('  - free: {op: signal, perm: "W - 1 - r", channel: f}\n'
             '  - freed: {op: wait, from: self, channel: f}\n')
    assert {d.code for d in _errors(tmp_path, mixed, [3])} == {"peer-mismatch"}
    by_offset = ("  - free: {op: signal, offset: 3, channel: f}\n"
                 "  - freed: {op: wait, offset: 3, channel: f}\n")
    local = ("  - keep: {op: copy, src: kv, dst: kv_recv}\n"
             "  - use: {op: external, reads: [kv_recv], writes: [out]}\n")
    for steps, moved in ((perm, {(2, 0), (0, 2)}), (by_offset, set())):
        assert _errors(tmp_path, local + steps, [3]) == []
        path = tmp_path / "nobody.yaml"
        path.write_text(HEAD + local + steps)
        plan, banks = _run_banks(path, 3)
        step = next(s for s in plan.steps if s.name == "free")
        for slot in range(plan.slots):
            chan = channel(step.index, slot, plan.slots)
            assert any(int(e) for b in banks for e in b.epochs[chan].tolist()), slot
            assert _moved(banks, chan) == moved, (steps, slot)


def _run_banks(path: Path, world: int) -> tuple:
    """The plan of ``path`` at ``world`` and each rank's signal bank (rank order) after a
    local run (ranks as threads, every access traced; the waits bounded at 30 s)."""
    banks: list = []
    made = SignalBank.__init__

    def keep(self: SignalBank, *args: object, **kwargs: object) -> None:
        made(self, *args, **kwargs)
        banks.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SignalBank, "__init__", keep)
        run = run_traced(str(path), world, programs=2, calls=2, seed=5, timeout_s=30.0)
    assert run.mismatches == 0 and run.problems == [] and len(banks) == world
    plan = pipeline.run(path, pipeline.Options(worlds=[world]), until="lower").plan
    return plan, _by_rank(banks, world)


def _moved(banks: list, chan: int) -> set:
    """The (bank's rank, signalling rank) cells of channel ``chan`` that hold a word."""
    return {(b, p) for b, bank in enumerate(banks)
            for p, words in enumerate(bank.sig[chan].tolist()) if any(words)}


AXIS = ("schedule: m\nmesh: {node: N, gpu: G}\nsizes: {N: {max: 4}, G: {max: 4}, D: 8}\n"
        "buffers:\n  x: {shape: [D], dtype: f32}\n"
        "  s: {shape: [D], dtype: f32, symmetric: true}\n"
        "  y: {shape: [D], dtype: f32}\nsteps:\n")


def test_self_with_axis_pairs_per_team_and_emits_the_team_lane(tmp_path: Path) -> None:
    """`to: self` / `from: self` with `axis: gpu`: proved at 2x2 and 2x3; its kernel's one
    lane is member RANK, mapped to the global rank through the team table; a self wait
    over another axis than its signal's is `peer-mismatch` (the same channel rules)."""
    steps = ("  - keep: {op: copy, src: x, dst: s}\n"
             "  - use: {op: external, reads: [s], writes: [y]}\n"
             "  - free: {op: signal, axis: gpu, to: self, channel: f}\n"
             "  - freed: {op: wait, axis: gpu, from: self, channel: f}\n")
    worlds = [MeshWorld((2, 2)), MeshWorld((2, 3))]
    assert _errors(tmp_path, steps, worlds, AXIS) == []
    text = pipeline.run(tmp_path / "credit.yaml", pipeline.Options(worlds=worlds[:1]),
                        until="emit").module_text
    body = text[text.index("def _free_kernel("):text.index("def _freed_kernel(")]
    assert "sig_peers = (RANK + sig_lane) % WORLD\n    sig_live = sig_lane < 1\n" in body
    assert "sig_peers = tl.load(team_ranks + sig_peers, mask=sig_live, other=0)" in body
    for name in ("free", "freed"):  # no handshake, no team barrier on per-axis backends
        assert _torch_branch(text, name) == [
            "pass  # the rank's own flag: its program order orders it on this backend"], name
    other = steps.replace("axis: gpu, from: self", "axis: node, from: self")
    assert {d.code for d in _errors(tmp_path, other, worlds[:1], AXIS)} == {"peer-mismatch"}


def test_the_emitted_lane_is_the_ranks_own_slot() -> None:
    """The file's self signal releases into sig[channel, RANK] of its own bank (one lane,
    peer RANK, no PEER parameter) and its self wait polls that cell; the torch backend
    makes neither: its branch is a no-op (no handshake, no barrier)."""
    text = pipeline.run(FILE, pipeline.Options(worlds=[3]), until="emit").module_text
    sig = text[text.index("def _open_own_kernel("):]
    sig = sig[:sig.index("\n\n\n")]
    assert "PEER" not in sig
    assert "    sig_peers = (RANK + sig_lane) % WORLD\n    sig_live = sig_lane < 1\n" in sig
    assert "sig_words = tl.load(sig_ptrs + sig_peers, mask=sig_live, other=0)" in sig
    assert "_dcpc_release(" in sig and "_dcpc_wait(" not in sig
    wait = text[text.index("def _own_credit_h0_kernel("):]
    wait = wait[:wait.index("\n\n\n")]
    assert "    sig_peers = (RANK + sig_lane) % WORLD\n    sig_live = sig_lane < 1\n" in wait
    assert "sig_mine = tl.load(sig_ptrs + RANK)" in wait and "_dcpc_release(" not in wait
    assert text.count("pass  # the rank's own flag: its program order orders it") == 6
    for name in ("open_own", "own_credit_h0", "free_own_h1", "drain_own"):
        assert _torch_branch(text, name) == [
            "pass  # the rank's own flag: its program order orders it on this backend"], name


def _torch_branch(text: str, step: str) -> list[str]:
    """The lines of ``step``'s torch-backend branch in the emitted module ``text``."""
    body = text[text.index(f"    def _checked_{step}("):]
    body = body[body.index("if _step in self._on_torch:"):]
    lines = body.splitlines()[1:]
    return [x.strip() for x in lines[:next(i for i, x in enumerate(lines)
                                          if x.strip() == "else:")]]


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [(3, "torch"), (3, "local"), (2, "host")],
                         ids=str)
def test_the_file_runs_against_float64(world: int, backend: str) -> None:
    """Every output of every call compared with the float64 reference: the kernels' self
    lanes (host: processes; local: ranks as threads), the torch backend's no-op."""
    report = run_schedule(RunConfig(schedule=str(FILE), world=world, backend=backend,
                                    calls=4, seed=5))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert report.outputs and all(s.compared > 0 for s in report.outputs.values()), text


@pytest.mark.e2e
def test_a_local_run_publishes_each_self_signal_on_the_ranks_own_cell() -> None:
    """What only the self lane makes (program order hides it from the outputs): after a
    local run (ranks as threads of this process, the Triton interpreter, every access
    traced) every self signal step's epoch is in its rank's OWN bank at sig[channel,
    RANK] (dcpc/runtime/sync.py: the low 32 bits of the word, one per program the kernel
    advanced), and no other rank's cell of that channel moved: a lane masked off, or
    pointed at another rank, fails it (the waits bounded at 30 s: a hang fails too)."""
    world = 3
    plan, banks = _run_banks(FILE, world)
    selves = [s for s in plan.steps if s.attrs.get("peers") == "self" and s.attrs.get("signal")]
    assert [s.name for s in selves] == ["open_own", "free_own_h0", "free_own_h1"]
    seen = 0
    for step in selves:
        for slot in range(plan.slots):
            chan = channel(step.index, slot, plan.slots)
            for rank, bank in enumerate(banks):
                epochs = [int(e) for e in bank.epochs[chan].tolist()]
                words = bank.sig[chan].tolist()
                for p, epoch in enumerate(epochs):
                    if epoch == 0:
                        continue  # a program this step's launches did not use
                    seen += 1
                    assert wrap_int32(int(words[rank][p]) & 0xFFFFFFFF) == epoch, (
                        step.name, slot, rank, p, words[rank][p], epoch)
            assert _moved(banks, chan) == {(r, r) for r in range(world)}, (step.name, slot)
    assert seen >= len(selves) * world


def _by_rank(banks: list, world: int) -> list:
    """The banks in rank order: rank r's own segment is entry r of its peer pointers."""
    found = {[int(p) for p in b.sig_ptrs.tolist()].index(b.flags.data_ptr()): b
             for b in banks}
    assert sorted(found) == list(range(world)), sorted(found)
    return [found[r] for r in range(world)]


SPAN = ("schedule: span\nslots: 1\nsizes: {N: 4, D: 8}\nbuffers:\n"
        "  x: {shape: [N, D], dtype: f32}\n  act: {shape: [N, D], dtype: f32}\n"
        "  recv: {shape: [N, D], dtype: f32, symmetric: true}\n"
        "  out: {shape: [N, D], dtype: f32}\nsteps:\n"
        "  - receive: {op: shift, src: act, dst: recv, offset: next, wrap: false, "
        "phase: wait}\n"
        "  - own: {op: signal, to: self, channel: o}\n"
        "  - owned: {op: wait, from: self, channel: o}\n"
        "  - first: {op: external, when: \"rank == 0\", reads: [x], writes: [act]}\n"
        "  - stage: {op: external, when: \"rank > 0\", reads: [recv], writes: [act]}\n"
        "  - send: {op: shift, src: act, dst: recv, offset: next, wrap: false, "
        "phase: put}\n"
        "  - credit: {op: signal, to: prev, channel: free}\n"
        "  - last: {op: external, when: \"rank == W - 1\", reads: [act], writes: [out]}\n"
        "  - freed: {op: wait, from: next, channel: free}\n")


@pytest.mark.e2e
def test_a_self_credit_may_stand_between_a_wait_and_its_later_put(tmp_path: Path) -> None:
    """A self signal and wait touch no other rank (the torch backend: no-ops), so they
    stand between a chain's wait and its put as a local step does: proved at 2..8 (the
    brute force and the execution oracle agree at 2 and 3) and run
    against float64 on the torch backend (its guard's handshakes on) and locally; a
    signal to a peer there is still `wait-first-span`."""
    path = tmp_path / "span.yaml"
    path.write_text(SPAN)
    pipeline.run(path, pipeline.Options(worlds=list(range(2, 9))), until="hb")
    for world, schedule in unrolled(SPAN, (2, 3)):  # the brute force and the oracle agree
        assert_brute_force_agrees(schedule, world, SPAN)
        assert disagreements(schedule, [world]) == [], world
    for backend in ("torch", "local"):
        report = run_schedule(RunConfig(schedule=str(path), world=3, backend=backend,
                                        calls=3, seed=5))
        text = format_report(report)
        assert report.launch.ok and report.mismatches == 0, text
        assert report.outputs and all(s.compared > 0 for s in report.outputs.values()), text
    peer = SPAN.replace("{op: signal, to: self, channel: o}", "{op: signal, to: next, "
                        "channel: o}").replace("from: self, channel: o", "from: prev, "
                                               "channel: o")
    found = [d for d in diagnostics(peer, tmp_path, "peer.yaml", [3]) if d.severity == "error"]
    assert [d.code for d in found] == ["wait-first-span"], found
    assert "step 'own' (signal) between them communicates" in found[0].message


def test_offset_zero_and_offset_self_on_a_wait_get_one_error_whose_hint_is_accepted(
        tmp_path: Path) -> None:
    """A wait by `offset: 0` polling a `to: self` signal is `bad-offset` only (no second
    `peer-mismatch` suggesting offset 0); `offset: self` is `bad-offset` whose hint names
    `to: self` / `from: self`; followed, both are proved."""
    zero = ("  - free: {op: signal, to: self, channel: f}\n"
            "  - freed: {op: wait, offset: 0, channel: f}\n")
    found = _errors(tmp_path, zero, [2, 3])
    assert [(d.code, d.mark.line) for d in found] == [("bad-offset", 10)], found
    assert "offset 0" not in (found[0].hint or "")
    assert _errors(tmp_path, zero.replace("offset: 0", "from: self"), [2, 3]) == []
    named = ("  - free: {op: signal, offset: self, channel: f}\n"
             "  - freed: {op: wait, offset: self, channel: f}\n")
    found = _errors(tmp_path, named, [3])
    assert [(d.code, d.mark.line) for d in found] == [("bad-offset", 9), ("bad-offset", 10)]
    assert "write 'to: self' instead of 'offset'" in found[0].hint
    assert "write 'from: self' instead of 'offset'" in found[1].hint
    fixed = named.replace("signal, offset: self", "signal, to: self").replace(
        "wait, offset: self", "wait, from: self")
    assert _errors(tmp_path, fixed, [2, 3]) == []


def test_offset_all_gets_a_hint_naming_to_all_and_from_all(tmp_path: Path) -> None:
    """`offset: all` (every peer, not one per rank) is the unroller's `bad-offset`, its
    hint the step's own key (`to: all` / `from: all`: drop the offset, as 'self' gets
    `to: self`), not the generic offset syntax; followed, proved."""
    named = ("  - free: {op: signal, offset: all, channel: f}\n"
             "  - freed: {op: wait, offset: all, channel: f}\n")
    found = _errors(tmp_path, named, [3])
    assert [(d.code, d.mark.line) for d in found] == [("bad-offset", 9), ("bad-offset", 10)]
    assert "by offset 'all', which names 'all'" in found[0].message
    assert found[0].hint == "drop 'offset' (all peers: 'to: all')"
    assert found[1].hint == "drop 'offset' (all peers: 'from: all')"
    assert _errors(tmp_path, named.replace(" offset: all,", ""), [2, 3]) == []


@pytest.mark.parametrize(("sent", "polled"), [
    ("to: self", "from: self"), ("to: next", "from: prev"), ("to: all", "from: all")])
def test_peers_that_agree_over_another_axis_get_a_hint_naming_the_axis(
        tmp_path: Path, sent: str, polled: str) -> None:
    """A wait whose signal's peers reach it but along another axis: `peer-mismatch`
    naming both teams, its hint the wait's axis on the signal; followed, proved."""
    steps = ("  - keep: {op: copy, src: x, dst: s}\n"
             "  - use: {op: external, reads: [s], writes: [y]}\n"
             f"  - free: {{op: signal, axis: gpu, {sent}, channel: f}}\n"
             f"  - freed: {{op: wait, axis: node, {polled}, channel: f}}\n")
    worlds = [MeshWorld((2, 2)), MeshWorld((2, 3))]
    found = _errors(tmp_path, steps, worlds[:1], AXIS)
    assert [d.code for d in found] == ["peer-mismatch"], found
    assert "along 'gpu'; this wait's are along 'node')" in found[0].message
    assert found[0].hint.startswith("use 'axis: node' on 'free'"), found[0].hint
    fixed = steps.replace(f"axis: gpu, {sent}", f"axis: node, {sent}")
    assert _errors(tmp_path, fixed, worlds, AXIS) == []


def test_a_guarded_self_signal_names_the_one_rank_whose_flag_it_is(tmp_path: Path) -> None:
    """A self signal under `when: "rank == 0"`, its wait unguarded: the message names the
    rank that runs the wait and skips the signal once (not 'ranks 1 and 1'); guarded
    alike, proved."""
    steps = ('  - free: {op: signal, to: self, channel: f, when: "rank == 0"}\n'
             "  - freed: {op: wait, from: self, channel: f}\n")
    found = _errors(tmp_path, steps, [3])
    assert [d.code for d in found] == ["when-on-communication"], found
    assert "ranks 1 and 1" not in found[0].message
    assert ("the condition differs between them on rank 1, whose own flag they are: it "
            "skips 'free' and runs 'freed', which waits for its own signal forever"
            in found[0].message), found[0].message
    fixed = steps.replace("from: self, channel: f}", 'from: self, channel: f, '
                          'when: "rank == 0"}')
    assert _errors(tmp_path, fixed, [2, 3]) == []
