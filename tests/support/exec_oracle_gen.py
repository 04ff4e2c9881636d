"""Random structurally valid schedules for the execution-oracle agreement test.

    schedule_text(seed) -> str       (YAML; the same seed gives the same schedule)
    valid_schedule(seed) -> (text, Schedule)   (the first valid draw from seed on)

What the draws cover (issue 12's classes among them): all_gather (block, interleaved,
into symmetric buffers that a fused exchange later reads as its src), all_to_all (also
with split_dim/concat_dim),
reduce_scatter (explicit and implicit via), all_reduce (likewise), reduce to a root and
broadcast (these three drawn in place of some reduce_scatters, so schedules without one
keep their draws), the fused
all_to_all_combine (own part read
from src after the wait, or copied into via when another step reads via), lse_combine,
copy, externals reading and writing symmetric buffers, barriers, and split-phase sync:
a signal/wait pair in any direction (``to: all`` with ``from: prev|next`` too), waits
before their signal, waits later than their signal, several signals on one channel, a
two-hop ring release, and a wait from next and a wait from prev on one channel. 1 to 3
slots, both stream modes, any symmetric buffer possibly ``shared``.
"""

from __future__ import annotations

import random
import re

HEADER = """\
schedule: gen_{seed}
slots: {slots}
streams: {streams}
sizes:
  N: 4
  K: {{multiple_of: W}}
buffers:
  x:    {{shape: [N, K], dtype: f32}}
  xs:   {{shape: [N, K/W, 2], dtype: f32}}
  xl:   {{shape: [N, K/W], dtype: f32, lse_base: e}}
  y:    {{shape: [N, K], dtype: f32}}
  y_rs: {{shape: [N, K/W], dtype: f32}}
  z:    {{shape: [W*N, K], dtype: f32}}
  o:    {{shape: [N, K, 2], dtype: f32}}
  ol:   {{shape: [N, K], dtype: f32, lse_base: e}}
  out:  {{shape: [N, K/W, 2], dtype: f32}}
  out2: {{shape: [N, K/W, 2], dtype: f32}}
  g0:   {{shape: [W*N, K], dtype: f32, symmetric: true{g0}}}
  g1:   {{shape: [W*N, K], dtype: f32, symmetric: true{g1}}}
  a0:   {{shape: [W, N, K/W], dtype: f32, symmetric: true{a0}}}
  s0:   {{shape: [N, K], dtype: f32, symmetric: true{s0}}}
  r0:   {{shape: [W, N, K/W], dtype: f32, symmetric: true{r0}}}
  v0:   {{shape: [W, N, K], dtype: f32, symmetric: true}}
  c0:   {{shape: [W*N, K/W], dtype: f32, symmetric: true}}
  os:   {{shape: [N, K, 2], dtype: f32, symmetric: true{os}}}
  osl:  {{shape: [N, K], dtype: f32, symmetric: true, lse_base: e{osl}}}
  vo:   {{shape: [W, N, K/W, 2], dtype: f32, symmetric: true{vo}}}
  vl:   {{shape: [W, N, K/W], dtype: f32, symmetric: true, lse_base: e{vl}}}
steps:
"""
SYMMETRIC = ("g0", "g1", "a0", "s0", "r0", "os", "osl", "vo", "vl")
# wait ``from`` -> the signal ``to`` values that reach it (docs/language.md)
REACHED_BY = {"all": ("all",), "prev": ("next", "all"), "next": ("prev", "all")}
KINDS = ("gather", "gather", "gather_os", "a2a", "rs", "fused", "fused", "combine", "copy",
         "ext", "ext", "ext", "barrier", "sync", "sync", "sync", "multi", "ring2", "both", "mixed")


def schedule_text(seed: int, max_steps: int = 7) -> str:
    """One random schedule (YAML text) of 1 .. ``max_steps`` draws (a draw is one to
    four steps); most are structurally valid."""
    rng = random.Random(seed)
    slots = rng.choice((1, 1, 2, 2, 3))
    streams = rng.choice(("per_slot", "single"))
    flags = {b: ", shared: true" if rng.random() < 0.2 else "" for b in SYMMETRIC}
    steps: list[str] = []
    written: set[str] = set()
    later: list[str] = []  # waits placed after some more steps
    channel = iter(f"c{i}" for i in range(100))

    def sig(to: str, ch: str) -> str:
        return f"{{op: signal, to: {to}, channel: {ch}}}"

    def wait(frm: str, ch: str) -> str:
        return f"{{op: wait, from: {frm}, channel: {ch}}}"

    for _ in range(rng.randint(1, max_steps)):
        kind = rng.choice(KINDS)
        if kind == "gather":
            dst = rng.choice(("g0", "g1"))
            extra = rng.choice(("", "", ", interleave: 1", ", interleave: 2"))
            steps.append(f"{{op: all_gather, src: x, dst: {dst}, dim: 0{extra}}}")
            written.add(dst)
        elif kind == "gather_os":
            src, dst = rng.choice((("xs", "os"), ("xl", "osl")))
            steps.append(f"{{op: all_gather, src: {src}, dst: {dst}, dim: 1}}")
            written.add(dst)
        elif kind == "a2a":
            if rng.random() < 0.5 and rng.random() < 0.4:  # split/concat into [W*N, K/W]
                steps.append("{op: all_to_all, src: x, dst: c0, split_dim: 1, concat_dim: 0}")
                written.add("c0")
            elif rng.random() < 0.5:
                steps.append("{op: all_to_all, src: x, dst: a0, dim: 1}")
                written.add("a0")
            else:
                steps.append("{op: all_to_all, src: [o, ol], dst: [vo, vl], dim: 1}")
                written |= {"vo", "vl"}
        elif kind == "rs" and rng.random() < 0.5:  # all_reduce: the whole src, same sync
            via = ", via: v0" if rng.random() < 0.4 else ""
            other = rng.random()  # or a broadcast, or a reduce to a root
            if other < 0.2:
                steps.append(f"{{op: broadcast, src: x, dst: s0, root: {rng.randint(0, 1)}}}")
                written.add("s0")
            elif other < 0.4:
                steps.append(f"{{op: reduce, src: x, dst: y, root: 1{via}}}")
                written.add("v0" if via else "")
            else:
                steps.append(f"{{op: all_reduce, src: x, dst: y, reduce: sum{via}}}")
                written.add("v0" if via else "")
        elif kind == "rs":
            via = ", via: r0" if rng.random() < 0.5 else ""
            steps.append(f"{{op: reduce_scatter, src: x, dst: y_rs, dim: 1{via}}}")
            written.add("r0" if via else "")
        elif kind == "fused":
            if "os" not in written and rng.random() < 0.4:  # a src that peers write
                steps.append("{op: all_gather, src: xs, dst: os, dim: 1}")
                written.add("os")
            o = "os" if "os" in written and rng.random() < 0.7 else "o"
            lse = "osl" if "osl" in written and rng.random() < 0.7 else "ol"
            steps.append(f"{{op: all_to_all_combine, src: [{o}, {lse}], via: [vo, vl], "
                         "dst: out, dim: 1}")
            written |= {"vo", "vl"}
        elif kind == "combine" and {"vo", "vl"} <= written:
            steps.append("{op: lse_combine, src: [vo, vl], dst: out2}")
        elif kind == "copy" and "g0" in written:
            steps.append("{op: copy, src: g0, dst: z}")
        elif kind == "barrier":
            steps.append("{op: barrier}")
        elif kind == "sync":
            ch = next(channel)
            frm = rng.choice(("all", "prev", "next"))
            to = rng.choice(REACHED_BY[frm])
            order = rng.choice(("split", "split", "later", "later", "wait-first"))
            if order == "wait-first":
                steps += [wait(frm, ch), sig(to, ch)]
            elif order == "later":
                steps.append(sig(to, ch))
                later.append(wait(frm, ch))
            else:
                steps += [sig(to, ch), wait(frm, ch)]
        elif kind == "multi":  # several signals on one channel, each polled by its wait
            ch = next(channel)
            frm = rng.choice(("all", "all", "prev", "next"))
            to = [rng.choice(REACHED_BY[frm]) for _ in range(2)]
            steps += [sig(to[0], ch), wait(frm, ch)]
            (later if rng.random() < 0.5 else steps).extend([sig(to[1], ch), wait(frm, ch)])
        elif kind == "ring2":  # a two-hop ring release on one channel
            ch = next(channel)
            to, frm = rng.choice((("next", "prev"), ("prev", "next")))
            steps += [sig(to, ch), wait(frm, ch), sig(to, ch), wait(frm, ch)]
        elif kind == "both":  # a wait from next and a wait from prev on one channel
            ch = next(channel)
            order = [sig("next", ch), sig("prev", ch)]
            rng.shuffle(order)
            waits = [wait("prev", ch), wait("next", ch)]
            rng.shuffle(waits)
            steps += order + waits
        elif kind == "mixed":  # signals and waits of any direction on one channel
            ch = next(channel)
            mixed = [sig(rng.choice(("all", "next", "prev")), ch) for _ in range(rng.randint(1, 3))]
            mixed += [wait(rng.choice(("all", "next", "prev")), ch)
                      for _ in range(rng.randint(1, len(mixed)))]
            rng.shuffle(mixed)
            steps += mixed
        else:
            reads = sorted(set(rng.sample(sorted(written - {""}),
                                          k=min(len(written - {""}), rng.randint(0, 2)))))
            target = rng.choice(["y", "s0", "s0", "g0", "os"])
            if target in ("g0", "os") and target not in written:
                target = "s0"
            steps.append(f"{{op: external, reads: [{', '.join(reads + ['x'])}], "
                         f"writes: [{target}]}}")
            if target != "y":
                written.add(target)
        if later and rng.random() < 0.5:
            steps.append(later.pop(0))
    steps += later
    if not steps:
        steps.append("{op: barrier}")
    body = "".join(f"  - t{i}: {s}\n" for i, s in enumerate(steps))
    header = HEADER.format(seed=seed, slots=slots, streams=streams, **flags).splitlines()
    start = header.index("buffers:") + 1
    used = [line for line in header[start:-1]
            if line.startswith("  x:") or re.search(rf"\b{line.split(':')[0].strip()}\b", body)]
    return "\n".join(header[:start] + used + header[-1:]) + "\n" + body


def load(text: str) -> object:
    """The ``Schedule`` of a generated text, fast: libyaml and the pydantic model, as
    dcpc.lang.parse does but without source marks (findings then point nowhere; the
    agreement test compares kinds, buffers and steps). 3x faster than parse_text,
    which the tests show gives an equal model."""
    import yaml

    from dcpc.lang import model

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    schedule = model.Schedule.model_validate(yaml.load(text, Loader=loader))
    schedule.set_source("<generated>", "0" * 64)
    return schedule


def valid_schedule(seed: int, worlds: range = range(2, 6),
                   max_steps: int = 7) -> tuple[str, object]:
    """The first structurally valid draw from ``seed`` on (seeds seed, seed + 10**6, ...)."""
    from dcpc.check import structural

    for attempt in range(50):
        text = schedule_text(seed + attempt * 10**6, max_steps)
        schedule = load(text)
        if not [d for d in structural.check(schedule, worlds) if d.severity == "error"]:
            return text, schedule
    raise AssertionError(f"no valid schedule from seed {seed}")


# --- a ring slot read block by block (a slot's chunk along its axis 0) ----------------
# tests/lang/slot_chunk_axis0.yaml with random changes: the three race models must agree
# on a local read of chunk j beside a ragged put into block m of the slot (apart iff
# m != j: chunk-precise) as on the coarse accesses around it
CHUNK_RING = "tests/lang/slot_chunk_axis0.yaml"
RING_LAND = """\
              - landed: {op: ragged_all_to_all, phase: wait, offset: h + 1, src: "x[c]",
                         dst: "ring[c % S]", counts: "n[c]", capacity: C}
"""
RING_TAKE = """\
              - take: {op: external, reads: ["ring[c % S][(r - (h + 1)) % W]"],
                       writes: ["y[W * c + (r - (h + 1)) % W]"]}
"""
RING_OWN = ('        - take_own: {op: external, reads: ["ring[c % S][r]"], '
        'writes: ["y[W * c + r]"]}')
RING_FREE = '- free: {op: signal, offset: "0 - (h + 1)", channel: head}'
_CREDIT_LINE = '              - credit: {op: wait, offset: "0 - (h + 1)", channel: head}\n'
_PUT = """\
              - put: {op: ragged_all_to_all, phase: put, offset: h + 1, src: "x[c + S]",
                      dst: "ring[c % S]", counts: "n[c + S]", capacity: C}
"""
_CREDIT_PUT = _CREDIT_LINE + _PUT
CHUNK_CHANGES: dict[str, tuple[str, ...]] = {
    # a source's block before its landing
    "early_read": (RING_LAND + RING_TAKE, RING_TAKE + RING_LAND),
    "wrong_head": (RING_FREE, '- free: {op: signal, offset: "h + 1", channel: head}'),
    "credit_after_put": (_CREDIT_PUT, _PUT + _CREDIT_LINE),  # the refill before its head
    "whole_own": (RING_OWN, '        - take_own: {op: external, reads: ["ring[c % S]"], '
                  'writes: ["z[c]"]}', "  y: {shape",
                  "  z: {shape: [P, W, C, D], dtype: f32}\n  y: {shape"),
    "other_block": (RING_OWN, RING_OWN.replace('"ring[c % S][r]"', '"ring[c % S][(r + 1) % W]"')),
    "one_slot": ("S: 2}", "S: 1}"),
    "three_slots": ("P: 3, S: 2}", "P: 4, S: 3}"),
    "rank_chunk_whole": (RING_TAKE, RING_TAKE.replace('"ring[c % S][(r - (h + 1)) % W]"',
                                              '"ring[c % S]"')),
}


def chunk_ring_text(seed: int) -> tuple[str, list[str]]:
    """The ring of tests/lang/slot_chunk_axis0.yaml with 0 to 3 of CHUNK_CHANGES drawn by
    ``seed`` (those that still apply after the others), and their names."""
    from pathlib import Path

    rng = random.Random(seed)
    text = (Path(__file__).parents[2] / CHUNK_RING).read_text()
    names = rng.sample(sorted(CHUNK_CHANGES), k=rng.randint(0, 3))
    done = []
    for name in names:
        change = CHUNK_CHANGES[name]
        if all(old in text for old in change[::2]):
            for old, new in zip(change[::2], change[1::2], strict=True):
                text = text.replace(old, new)
            done.append(name)
    return text, done
