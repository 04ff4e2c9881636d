"""Property test for the MoE ops: on random schedules of ragged all_to_alls (with and
without a per-token fp8 cast), all_to_alls with a cast, weighted combines, externals,
barriers and split-phase signal/wait (waits before their signal too), 1 or 2 slots,
either stream mode, receive buffers possibly ``shared``, the happens-before checker, the
brute force
(tests/support/hb_oracle.py, full unrolling, no symmetry) and the execution oracle agree.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import disagreements
from support.hb_oracle import oracle_keys

from dcpc.check import hb, structural
from dcpc.lang.parse import parse_text

HEADER = """\
schedule: moe_random
slots: {slots}
streams: {streams}
sizes: {{C: 2, H: 4, T: 2, K: 2}}
buffers:
  xs: {{shape: [W, C, H], dtype: bf16}}
  n:  {{shape: [W], dtype: i32}}
  r0: {{shape: [W, C, H], dtype: fp8e4m3, symmetric: true{r0}}}
  s0: {{shape: [W, C], dtype: f32, symmetric: true{s0}}}
  m0: {{shape: [W], dtype: i32, symmetric: true{m0}}}
  r1: {{shape: [W, C, H], dtype: bf16, symmetric: true{r1}}}
  m1: {{shape: [W], dtype: i32, symmetric: true{m1}}}
  ye: {{shape: [W, C, H], dtype: bf16}}
  w:  {{shape: [T, K], dtype: f32}}
  ix: {{shape: [T, K], dtype: i32}}
  o:  {{shape: [T, H], dtype: bf16}}
  xa: {{shape: [W*C, H], dtype: bf16}}
  qa: {{shape: [W, C, H], dtype: fp8e4m3, symmetric: true{qa}}}
  sa: {{shape: [W, C], dtype: f32, symmetric: true{sa}}}
steps:
"""
PARTNER = {"all": "all", "next": "prev", "prev": "next"}


def moe_schedule_text(draw) -> str:  # noqa: ANN001 (hypothesis' draw)
    flags = {b: ", shared: true" if draw(st.integers(0, 3)) == 0 else ""
             for b in ("r0", "s0", "m0", "r1", "m1", "qa", "sa")}
    steps: list[str] = []
    written: set[str] = set()
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["disp", "disp", "ret", "exp", "exp", "comb", "barrier",
                                     "sync", "sync", "a2a"]))
        if kind == "disp":
            steps.append("{op: ragged_all_to_all, src: xs, dst: r0, counts: n, "
                         "recv_counts: m0, capacity: C, scale: {per: token, buffer: s0}}")
            written |= {"r0", "s0", "m0"}
        elif kind == "ret" and "ye" in written:
            counts = "m0" if "m0" in written and draw(st.booleans()) else "n"
            steps.append(f"{{op: ragged_all_to_all, src: ye, dst: r1, counts: {counts}, "
                         "recv_counts: m1, capacity: C}")
            written |= {"r1", "m1"}
        elif kind == "exp":
            sym = sorted(written - {"ye"})
            reads = sorted(set(draw(st.lists(st.sampled_from(sym), max_size=3)))) if sym else []
            steps.append(f"{{op: external, reads: [{', '.join(reads + ['xs'])}], writes: [ye]}}")
            written.add("ye")
        elif kind == "comb" and "r1" in written:
            steps.append("{op: weighted_combine, src: [r1, w], index: ix, dst: o}")
        elif kind == "a2a":  # an all_to_all with a per-token fp8 cast
            steps.append("{op: all_to_all, src: xa, dst: qa, scale: {per: token, buffer: sa}}")
            written |= {"qa", "sa"}
        elif kind == "barrier":
            steps.append("{op: barrier}")
        elif kind == "sync":
            to = draw(st.sampled_from(["all", "next", "prev"]))
            channel = f"c{'a' if to == 'all' else 'r'}{draw(st.integers(0, 1))}"
            pair = [f"{{op: signal, to: {to}, channel: {channel}}}",
                    f"{{op: wait, from: {PARTNER[to]}, channel: {channel}}}"]
            steps += pair[::-1] if draw(st.integers(0, 2)) == 0 else pair  # wait first: hangs
    if not steps:
        steps.append("{op: barrier}")
    head = HEADER.format(slots=draw(st.integers(1, 2)),
                         streams=draw(st.sampled_from(["per_slot", "single"])), **flags)
    return head + "".join(f"  - t{i}: {s}\n" for i, s in enumerate(steps))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_brute_force_and_execution_agree_on_moe_schedules(data: st.DataObject) -> None:
    text = moe_schedule_text(data.draw)
    schedule = parse_text(text)
    errors = [d for d in structural.check(schedule, range(2, 5)) if d.severity == "error"]
    assert errors == [], (text, errors)
    for world in (2, 3, 4):
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert found == oracle_keys(schedule, world), (text, world)
    assert disagreements(schedule, [2, 3]) == [], text
