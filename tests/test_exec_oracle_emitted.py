"""The execution oracle's model of signals and waits is what the emitted kernels do.

dcpc/check/oracle.py executes the plan's ``sync`` the way templates/sync.j2 is written:
a signalling step's kernel advances its epoch of channel ``index * slots + slot`` once,
stores it (release) into ``sig[sig_channel, RANK]`` of each peer its signal names, and
spins (acquire, wrap-safe int32 compare) on its own ``sig[sig_channel, peer]`` for each
peer its wait names, ``sig_channel`` being ``polls * slots + slot`` (its own index for a
signal-only step); a fused exchange reads its own part from src after its wait exactly
when its plan says so. This test reads the EMITTED modules of every corpus and shipped
schedule, and of 40 random ones, and checks each of those facts, so that a change of
the sync protocol in the templates cannot leave the oracle (and the agreement test)
executing something else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from exec_oracle_gen import valid_schedule

from dcpc.codegen.emit import emit
from dcpc.codegen.lower import lower
from dcpc.diagnostics import DiagnosticError
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted((ROOT / "tests" / "hb_corpus").glob("*.yaml")) + sorted(
    (ROOT / "schedules").glob("*.yaml"))
PEER = re.compile(r"^\s*peer = \(RANK \+ (k|1|WORLD - 1)\) % WORLD\s*$")
KIND = {"k": "all", "1": "next", "WORLD - 1": "prev"}


def _function(text: str, name: str) -> str:
    """The source of the module-level function ``name`` (up to the next top-level def)."""
    start = text.index(f"\ndef {name}(")
    end = re.compile(r"\n(@|def |class )").search(text, start + 1)
    return text[start:end.start() if end else len(text)]


def _peer_loops(body: str, call: str) -> list[str]:
    """For each call of ``call`` in ``body``: the peers of the loop it runs in."""
    lines = body.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip().startswith(call + "("):
            kinds = [PEER.match(x) for x in lines[:i]]
            found = [m.group(1) for m in kinds if m]
            assert found, f"no peer loop before {call} in:\n{body}"
            out.append(KIND[found[-1]])
    return out


def test_the_sync_helpers_use_the_slots_and_the_compare_the_oracle_models() -> None:
    plan = lower(parse_file(ROOT / "schedules" / "kimi_k3_dcp.yaml"), range(2, 9))
    text = emit(plan)
    signal = _function(text, "_dcpc_signal")
    assert "_dcpc_pick(sig_table, peer," in signal  # the PEER's bank
    assert "(sig_channel * WORLD + RANK)" in signal  # ... its slot for this rank
    assert 'sem="release"' in signal
    wait = _function(text, "_dcpc_wait")
    assert "_dcpc_pick(sig_table, RANK," in wait  # this rank's own bank
    assert "(sig_channel * WORLD + peer)" in wait  # ... the slot the peer writes
    assert 'sem="acquire"' in wait
    assert "(got.to(tl.int32) - epoch) < 0" in wait  # wrap-safe: passes when >= 0
    advance = _function(text, "_dcpc_advance_epoch")
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


CASES = [(p.name, p) for p in FILES] + _generated(40)


@pytest.mark.parametrize(("name", "source"), CASES, ids=[c[0] for c in CASES])
def test_every_kernel_signals_and_waits_as_its_plan_says(name: str, source: object) -> None:
    schedule = parse_file(source) if isinstance(source, Path) else source
    try:
        plan = lower(schedule, range(2, 9))
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
        signals = _peer_loops(body, "_dcpc_signal")
        waits = _peer_loops(body, "_dcpc_wait")
        assert set(signals) == ({sync.signal} if sync.signal else set()), (step.name, signals)
        assert set(waits) == ({sync.wait} if sync.wait else set()), (step.name, waits)
        launch = re.search(
            rf"_{step.name}_kernel\[[^\n]*\]\(\n(?:[^\n]*\n)*?\s*self\._bank\.errors,\n"
            r"\s*(\d+) \+ slot,\n\s*(\d+) \+ slot,", text)
        assert launch, f"no launch of _{step.name}_kernel with its channels"
        channel, sig_channel = int(launch.group(1)), int(launch.group(2))
        assert channel == step.index * plan.slots, step.name
        polled = sync.polls if sync.polls is not None else step.index
        assert sig_channel == polled * plan.slots, step.name
        if step.op == "all_to_all_combine":  # its own part from src after the wait?
            method = text[text.index(f"    def {step.name}("):]
            method = method[:method.find("\n    def ", 1)]
            after = any(e.when == "after" and e.key.startswith("src") for e in step.effects)
            assert ("FROM_SRC=self.rank" in method) == after, step.name
            assert ("FROM_SRC=-1" in method) == (not after), step.name
        checked += 1
    assert checked or not any(s.sync.signal or s.sync.wait for s in plan.steps)
