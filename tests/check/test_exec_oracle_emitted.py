"""The execution oracle's model of signals and waits is what the emitted kernels do.

dcpc/check/oracle.py executes the plan's ``sync`` the way templates/sync.j2 is written:
a signalling step's kernel advances its epoch of channel ``index * slots + slot`` once,
stores it (release) into ``sig[sig_channel, RANK]`` of each peer its signal names, and
spins (acquire, wrap-safe int32 compare) on its own ``sig[sig_channel, peer]`` for each
peer its wait names, ``sig_channel`` being ``polls * slots + slot`` (its own index for a
signal-only step); the peers are the lanes of one vector (``sig_peers``, masked by
``sig_live``: all, next or prev), released to and polled at once; a fused exchange
reads its own part from src after its wait exactly when its plan says so. This test
reads the EMITTED modules of every corpus and shipped schedule, and of 40 random ones,
and checks each of those facts, so that a change of the sync protocol in the templates
cannot leave the oracle (and the agreement test) executing something else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.exec_oracle_gen import valid_schedule

from dcpc.codegen.emit import emit
from dcpc.codegen.lower import lower
from dcpc.diagnostics import DiagnosticError
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "tests" / "hb_corpus").glob("*.yaml")) + sorted(
    (ROOT / "schedules").glob("*.yaml")) + sorted((ROOT / "tests" / "shift").glob("*.yaml"))
# the kernel's lanes (templates/sync.j2, prologue): which peers it signals and polls
PEERS = re.compile(r"^\s*sig_peers = \(RANK \+ (1|WORLD - 1) \+ sig_lane\) % WORLD\s*$")
LIVE = re.compile(r"^\s*sig_live = sig_lane < (WORLD - 1|tl\.minimum\(WORLD - 1, 1\))\s*$")
KIND = {("1", "WORLD - 1"): "all", ("1", "1"): "next", ("WORLD - 1", "1"): "prev"}
# a shift's one lane: the peer TO (its signal) or FROM (its wait), launch arguments
ONE = re.compile(r"^\s*sig_peers = \((TO|FROM) \+ sig_lane\) % WORLD\s*$")
ONE_LIVE = re.compile(r"^\s*sig_live = \(sig_lane < 1\) & \(sig_peers != RANK\)\s*$")
ONE_ARG = re.compile(r"^\s*\((TO|FROM) \+ sig_lane\) % WORLD,$")


def _function(text: str, name: str) -> str:
    """The source of the module-level function ``name`` (up to the next top-level def)."""
    start = text.index(f"\ndef {name}(")
    end = re.compile(r"\n(@|def |class )").search(text, start + 1)
    return text[start:end.start() if end else len(text)]


def _peer_lanes(body: str, call: str) -> list[str]:
    """For each call of ``call`` in ``body``: the peers of the lanes it runs on (a
    shift's one peer: "TO" or "FROM", the launch argument that names it)."""
    lines = body.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip().startswith(call + "("):
            args = lines[i + 1:i + 5]
            inline = [m.group(1) for m in map(ONE_ARG.match, args) if m]
            if inline:  # a whole shift's wait: the lane passed as the arguments
                assert any(a.strip() == f"(sig_lane < 1) & (({inline[0]} + sig_lane) % WORLD"
                           " != RANK)," for a in args), args
                out.append(inline[0])
                continue
            one = [(k, m.group(1)) for k, m in enumerate(map(ONE.match, lines[:i])) if m]
            if one:
                k, name = one[-1]
                assert ONE_LIVE.match(lines[k + 1]), lines[k + 1]
                assert any("sig_live" in a for a in lines[i + 1:i + 5]), lines[i + 1:i + 5]
                out.append(name)
                continue
            peers = [m.group(1) for m in map(PEERS.match, lines[:i]) if m]
            live = [m.group(1) for m in map(LIVE.match, lines[:i]) if m]
            live = ["1" if x.startswith("tl.minimum") else x for x in live]  # next/prev
            assert peers and live, f"no peer lanes before {call} in:\n{body}"
            args = lines[i + 1:i + 5]
            assert any("sig_live" in a for a in args), (call, args)  # masked to the peers
            out.append(KIND[(peers[-1], live[-1])])
    return out


def test_the_sync_helpers_use_the_slots_and_the_compare_the_oracle_models() -> None:
    plan = lower(parse_file(ROOT / "schedules" / "kimi_k3_dcp.yaml"), range(2, 9))
    text = emit(plan)
    kernel = _function(text, "_query_gather_kernel")
    assert "sig_mine = tl.load(sig_ptrs + RANK)" in kernel  # this rank's own bank
    assert "sig_words = tl.load(sig_ptrs + sig_peers, mask=sig_live" in kernel  # the PEERS'
    assert "sig_bases = sig_words.to(tl.pointer_type(tl.int64))" in kernel
    assert "_dcpc_release(\n        sig_bases," in kernel
    assert "_dcpc_wait(\n        sig_ptrs,\n        sig_mine," in kernel
    # the helpers: the device library every module imports them from (one definition)
    assert re.search(r"^from dcpc\.runtime\.device import \(\n(    _dcpc_\w+,\n)+\)$", text,
                     re.M)
    library = (ROOT / "dcpc" / "runtime" / "device.py").read_text()
    assert "\ndef _dcpc_release(" not in text and "\ndef _dcpc_wait(" not in text
    signal = _function(library, "_dcpc_release")
    assert "bases + WORLD + (sig_channel * WORLD + RANK)" in signal  # its slot for this rank
    assert 'mask=live, sem="release"' in signal
    wait = _function(library, "_dcpc_wait")
    assert "mine + WORLD + (sig_channel * WORLD + peers)" in wait  # the slot the peer writes
    assert 'mask=live, sem="acquire"' in wait
    assert "(got.to(tl.int32) - epoch) < 0" in wait  # wrap-safe: passes when >= 0
    assert "_dcpc_spin(cells," in wait
    spin = _function(library, "_dcpc_spin")
    assert 'tl.atomic_add(cells, 0, mask=pending, sem="acquire"' in spin
    assert "(got.to(tl.int32) - epoch) < 0" in spin
    advance = _function(library, "_dcpc_advance_epoch")
    assert "epochs + channel * sig_programs" in advance and "+ 1" in advance


def _generated(count: int) -> list[tuple[str, object]]:
    """Random schedules with a fused exchange, an lse_combine or split-phase sync."""
    out = []
    for seed in range(10 * count):
        text, schedule = valid_schedule(seed)
        if re.search(r"all_to_all_combine|lse_combine|op: wait", text):
            out.append((f"gen_{seed}", schedule))
        if len(out) == count:
            break
    return out


def _one_peer(text: str, step: str, lane: str) -> str:
    """A shift's TO/FROM lane as the sync names its peer ("next", "prev", "+k" / "-k":
    dcpc.ops.common.offset_peers, rank + k), read off the step's launch; else ``lane``.
    Without wrap ("line+k"): rank + k only where it is a rank, else the rank itself (the
    lane is masked off: no signal, no wait)."""
    if lane not in ("TO", "FROM"):
        return lane
    head = f"_{step}_kernel[(_grid,)]("
    start = text.index(head)
    after = re.compile(r"\b_\w+_kernel\[").search(text, start + len(head))
    launch = text[start:after.start() if after else len(text)]  # this launch's, no later
    table = re.search(rf"\n\s*{lane}=\(([-\d, ]+)\)\[self\.rank\],\n", launch)
    if table:  # a perm: each rank's peer, itself where it has none (its lane masked)
        return _no_self("perm:" + ",".join(table.group(1).replace(" ", "").split(",")))
    line = re.search(rf"\n\s*{lane}=\(self\.rank ([+-]) (-?\d+)\s+if 0 <= self\.rank "
                     r"\1 \2 < self\.world else self\.rank\),\n", launch)
    found = line or re.search(rf"\n\s*{lane}=\(self\.rank ([+-]) (-?\d+)\) % self\.world,\n",
                              launch)
    assert found, f"no {lane} in the launch of _{step}_kernel"
    k = int(found.group(2)) * (1 if found.group(1) == "+" else -1)
    if line:
        return f"line{k:+d}"
    return {1: "next", -1: "prev"}.get(k, f"{k:+d}")


def _no_self(spec: str | None) -> str | None:
    """A perm's peers ("perm:<table>") with every rank that names itself (a fixed point,
    which signals and waits for nobody) as -1, the table's "none"; others unchanged."""
    if spec is None or not spec.startswith("perm:"):
        return spec
    peers = [int(p) for p in spec[len("perm:"):].split(",")]
    return "perm:" + ",".join(str(-1 if p == r else p) for r, p in enumerate(peers))


CASES = [(p.name, p) for p in FILES] + _generated(40)


def _load(source: object) -> tuple[object, list[int]]:
    """A case's schedule and the worlds it is lowered for: 2..8, or W=4 alone for a
    file whose unrolled steps name W (a module serves one W then)."""
    if not isinstance(source, Path):
        return source, list(range(2, 9))
    try:
        return parse_file(source), list(range(2, 9))
    except DiagnosticError as err:
        if not any(d.code == "loop-world" for d in err.diagnostics):
            raise
    return parse_file(source, world=4), [4]


@pytest.mark.parametrize(("name", "source"), CASES, ids=[c[0] for c in CASES])
def test_every_kernel_signals_and_waits_as_its_plan_says(name: str, source: object) -> None:
    schedule, worlds = _load(source)
    try:
        plan = lower(schedule, worlds)
        text = emit(plan)
    except (DiagnosticError, ValueError):
        return  # refused before any code exists (the agreement test covers why)
    checked = 0
    for step in plan.steps:
        sync = step.sync
        if sync.signal is None and sync.wait is None:
            assert f"def _{step.name}_kernel(" not in text or step.op not in (
                "signal", "wait", "barrier")
            continue
        body = _function(text, f"_{step.name}_kernel")
        assert body.count("_dcpc_advance_epoch(epochs, channel,") == 1, step.name
        signals = [_one_peer(text, step.name, p) for p in _peer_lanes(body, "_dcpc_release")]
        waits = [_one_peer(text, step.name, p) for p in _peer_lanes(body, "_dcpc_wait")]
        assert set(signals) == ({_no_self(sync.signal)} if sync.signal else set()), (
            step.name, signals)
        assert set(waits) == ({_no_self(sync.wait)} if sync.wait else set()), (step.name, waits)
        launch = re.search(
            rf"_{step.name}_kernel\[[^\n]*\]\(\n(?:[^\n]*\n)*?\s*self\._bank\.errors,\n"
            r"\s*(\d+) \+ slot,\n\s*(\d+) \+ slot,", text)
        assert launch, f"no launch of _{step.name}_kernel with its channels"
        channel, sig_channel = int(launch.group(1)), int(launch.group(2))
        assert channel == step.index * plan.slots, step.name
        polled = sync.polls if sync.polls is not None else step.index
        assert sig_channel == polled * plan.slots, step.name
        if step.op == "all_to_all_combine":  # its own part from src after the wait?
            method = text[text.index(f"    def _checked_{step.name}("):]  # the checked path
            method = method[:method.find("\n    def ", 1)]
            after = any(e.when == "after" and e.key.startswith("src") for e in step.effects)
            assert ("FROM_SRC=self.rank" in method) == after, step.name
            assert ("FROM_SRC=-1" in method) == (not after), step.name
        checked += 1
    assert checked or not any(s.sync.signal or s.sync.wait for s in plan.steps)
