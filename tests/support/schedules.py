"""A schedule written into a test's folder, and what the pipeline says of it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from dcpc import pipeline
from dcpc.diagnostics import DiagnosticError
from support.hb_oracle import CREDIT_HEADER

# a copy then an all_gather into a symmetric g, one slot, no barrier: rank 1's next call
# pushes into rank 0's g before rank 0's gather returned it (the engine's read): proved
# ok until the checker modelled that read (issue 33 flaky22). tests/check/
# test_returned_reads.py checks it, tests/run/test_run_replay.py replays its race, and
# tests/codegen/test_new_op.py runs it with its copy an echo and a barrier at the end
GATHER_NO_BARRIER = """\
schedule: gather_no_barrier
slots: 1
sizes:
  T: {max: 8}
  D: 16
buffers:
  x: {shape: [T, D], dtype: f32}
  y: {shape: [T, D], dtype: f32}
  g: {shape: [T, W * D], dtype: f32, symmetric: true}
steps:
  - keep: {op: copy, src: x, dst: y}
  - gather: {op: all_gather, src: y, dst: g, dim: 1}
"""

# a ring of waits before signals that the last rank (no wait) and rank 0 (no signal) cut
# into a chain: the model, every rank alike, has a cycle; the ranks' real steps finish
GUARDED_CHAIN = CREDIT_HEADER.format(seed=5, slots=1) + """\
  - first: {op: wait, from: next, channel: c, when: "rank != W - 1"}
  - then:  {op: signal, to: prev, channel: c, when: "rank != 0"}
  - use:   {op: external, reads: [x], writes: [y]}
"""

# the review's repros (legal24): the guarded chain with a shift that no credit frees; the
# model, every rank alike, stops at its cycle and searches no race after it (the checker
# once said `ok` where the brute force finds 3 races, then refused it as a guarded-cycle):
# the ranks' real steps decide it (races.find_real_races)
CHAIN_RACE = GUARDED_CHAIN.replace(
    "  - use:   {op: external, reads: [x], writes: [y]}\n",
    "  - put:   {op: shift, src: x, dst: s, offset: 1}\n"
    "  - use:   {op: external, reads: [s], writes: [y]}\n")


# on a mesh an index may name the rank's coordinate along an axis: each GPU of a node
# writes its own slot, then ``trips`` (G - 1: all) others', then reads its own; the sum
# reads all (tests/lang/test_owner_index.py checks it, tests/run/test_owner_run.py runs it)
MESH_OWNER = """\
schedule: mesh_owner
mesh: {node: N, gpu: G}
sizes: {T: {max: 4}, D: 8}
buffers:
  x: {shape: [T, D], dtype: f32}
  y: {shape: [T, D], dtype: f32}
  parts: {shape: [G, T, D], dtype: f32}
  total: {shape: [T, D], dtype: f32}
steps:
  - put: {op: external, reads: [x], writes: ["parts[gpu]"]}
  - rest:
      repeat: TRIPS
      as: h
      steps:
        - other: {op: external, reads: [x], writes: ["parts[(gpu + h + 1) % G]"]}
  - mine: {op: copy, src: "parts[gpu]", dst: y}
  - all: {op: sum, src: parts, dst: total}
"""


def mesh_owner(trips: str = "G - 1") -> str:
    """``MESH_OWNER`` whose loop makes ``trips`` hops."""
    return MESH_OWNER.replace("TRIPS", trips)


def shift_head(*extra: str) -> str:
    """The head of the small shift schedules (``s``, sizes N = 4, D = 2: f32 ``x``, a
    symmetric ``y``, ``z``, then each of ``extra``, a buffer line) up to ``steps:``."""
    return ("schedule: s\nsizes: {N: 4, D: 2}\nbuffers:\n"
            "  x: {shape: [N, D], dtype: f32}\n"
            "  y: {shape: [N, D], dtype: f32, symmetric: true}\n"
            "  z: {shape: [N, D], dtype: f32}\n"
            + "".join(f"  {line}\n" for line in extra) + "steps:\n")


def ragged_head(name: str, cap: int = 4, h: int | str = 8, src: str = "bf16",
                dst: str = "bf16", s_shape: str | None = None, s_sym: bool = False) -> str:
    """The head of a ragged_all_to_all schedule ``name`` up to ``steps:``: ``x`` [W, C, H]
    of ``src`` sent by counts ``n`` into the symmetric ``y`` of ``dst`` with its
    ``recv_counts`` ``m``, C at most ``cap``; a cast's f32 scale buffer ``s`` of shape
    ``s_shape`` (symmetric if ``s_sym``) where given."""
    sym = ", symmetric: true" if s_sym else ""
    s = f"  s:  {{shape: {s_shape}, dtype: f32{sym}}}\n" if s_shape else ""
    return (f"schedule: {name}\nsizes: {{C: {{max: {cap}}}, H: {h}}}\nbuffers:\n"
            f"  x:  {{shape: [W, C, H], dtype: {src}}}\n"
            "  n:  {shape: [W], dtype: i32}\n"
            f"  y:  {{shape: [W, C, H], dtype: {dst}, symmetric: true}}\n{s}"
            "  m:  {shape: [W], dtype: i32, symmetric: true}\nsteps:\n")


def ragged_cast(cap: int = 6, h: int | str = 256, src: str = "bf16", dst: str = "fp8e4m3",
                s_shape: str = "[W, C, H/128]", s_sym: bool = True, per: str = "token",
                group: object = 128, rule: str | None = None, reads: str = "[y, s, m]") -> str:
    """A ragged_all_to_all ``cast`` that quantises (or, from fp8, dequantises) ``per``
    token in groups of ``group`` channels (None: no ``group:``) by ``rule`` (None: no
    ``rule:``) into ``s``, an external use reading ``reads``, a barrier. Its scale is
    on line 11 (the verifier tests' marks)."""
    spec = f"per: {per}, " + (f"group: {group}, " if group is not None else "") + "buffer: s"
    spec += f", rule: {rule}" if rule is not None else ""
    return ragged_head("cast", cap, h, src, dst, s_shape, s_sym) + (
        "  - move: {op: ragged_all_to_all, src: x, dst: y, counts: n, recv_counts: m, "
        f"capacity: C,\n          scale: {{{spec}}}}}\n"
        f"  - use:  {{op: external, reads: {reads}}}\n"
        "  - done: {op: barrier}\n")


def write(folder: Path, text: str, name: str = "schedule.yaml") -> Path:
    """``text`` as ``folder/name`` (the name shows in located messages)."""
    path = folder / name
    path.write_text(text)
    return path


def errors(path: Path, worlds: Sequence[int] = (2, 3)) -> list[tuple[str, int, int, str]]:
    """(code, line, col, message) of every diagnostic of a schedule the pipeline refuses
    (the test fails if it accepts it)."""
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(path, pipeline.Options(worlds=tuple(worlds)))
    return [(d.code, d.mark.line, d.mark.col, d.message) for d in err.value.diagnostics]


def diagnostics(source: str, folder: Path, name: str = "schedule.yaml",
                worlds: Sequence[int] = (2, 3)) -> list:
    """What the pipeline reports up to the happens-before check of a schedule it refuses
    (empty: accepted and proved)."""
    try:
        pipeline.run(write(folder, source, name), pipeline.Options(worlds=tuple(worlds)),
                     until="hb")
    except DiagnosticError as err:
        return list(err.diagnostics)
    return []


def error_marks(source: str, folder: Path, name: str = "schedule.yaml",
                worlds: Sequence[object] = (2, 3)) -> list[tuple[str, int, int]]:
    """(code, line, col) of every error ``diagnostics`` reports, sorted."""
    return sorted((d.code, d.mark.line, d.mark.col)
                  for d in diagnostics(source, folder, name, worlds)  # type: ignore[arg-type]
                  if d.severity == "error")


def codes(source: str, folder: Path, name: str = "schedule.yaml",
          worlds: Sequence[int] = (2, 3)) -> list[str]:
    """The error codes the pipeline reports up to the happens-before check, sorted and
    each once (empty: accepted and proved)."""
    return sorted({d.code for d in diagnostics(source, folder, name, worlds)
                   if d.severity == "error"})


def check_errors(text: str, worlds: Iterable[int] = (2, 3, 4)) -> list:
    """The errors the parser or the structural check reports of schedule ``text`` (file
    's.yaml'), without the happens-before check."""
    from dcpc.check import structural
    from dcpc.lang.parse import parse_text

    try:
        return [d for d in structural.check(parse_text(text, "s.yaml"), worlds)
                if d.severity == "error"]
    except DiagnosticError as error:  # a parse error is raised with its diagnostics
        return list(error.diagnostics)


def first_error(text: str, worlds: Iterable[int] = (2, 3, 4)) -> list[tuple[str, int, int]]:
    """(code, line, col) of ``check_errors``' first, as a list of at most one."""
    return [(d.code, d.mark.line, d.mark.col) for d in check_errors(text, worlds)][:1]


def run_clean(**config: object) -> tuple[object, str]:
    """``dcpc run`` of ``RunConfig(**config)``: the report and its text, asserting every
    rank ran and every compared output matches float64."""
    from dcpc.harness.run import RunConfig, format_report, run_schedule

    report = run_schedule(RunConfig(**config))  # type: ignore[arg-type]
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    return report, text


def run_ranks(source: str, folder: Path, world: int, sizes: dict[str, int],
              body: Callable[[Any, Any], str]) -> list[str]:
    """``source`` compiled at ``world`` and run on the local backend (ranks as threads):
    per rank, what ``body(instance, rank)`` returns, or the message of the
    ``DcpcArgumentError`` / ``DcpcPeerFailedError`` it raised (a kernel's error record)."""
    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.errors import DcpcArgumentError, DcpcPeerFailedError
    from dcpc.runtime.local import LocalGroup

    path = write(folder, source, "ranks.yaml")
    _, module, _, _ = compile_to(str(path), folder, world)
    name = source.split("schedule:", 1)[1].split()[0]

    def rank_main(rank: Any) -> str:
        inst = load_module_class(module, name)(rank, sizes=sizes, device="cpu",
                                               backend="local", timeout_s=20)
        try:
            return body(inst, rank)
        except (DcpcArgumentError, DcpcPeerFailedError) as exc:
            return str(exc)
        finally:
            inst.close()

    return LocalGroup(world, "cpu", timeout_s=60).run(rank_main)
