"""The per-op conformance schedules (schedules/ops/): every op and every kernel path the
code generator emits, proved for the worlds each file claims, run on CPU against float64,
and the set complete.

A file is one op's kernel path, or one variant of an op that lowers differently, kept
small. Its header says what it claims, as a gallery file's does (tests/cli/test_gallery.py):

    # op: all_gather          the op(s) the file is for (names in dcpc.ops.OPS)
    # check: 2..8             worlds `dcpc check` proves (mesh shapes: 2..4x2..4)
    # run: 2 3                worlds CI runs on CPU against float64 (host backend)

The runs bind every per-call size at the maximum the file declares (the harness would
lower T to 8), so call 0 runs at the maxima, call 1 at 1 and calls 2 and 3 at random
sizes in between; the first run world of several runs one program per launch (it loops
over every tile), the others two. The maxima make the payloads of every kernel path
larger than the smallest tile (dcpc.runtime.module.MIN_BLOCK elements), so that a
launch at them splits its tiles over both programs (LSE-sized payloads and local copies
may stay in one). The GPU conformance suite runs the same files at W = 2, 4, 8 and on
meshes 2x2, 2x4, 4x2.

Completeness: every op has a file (an op without a kernel template, `external`, a
step in one), every key of every op's model is set by some step and every value of its
enumerations taken, and every kernel variant in VARIANTS is lowered by some file. A
variant that fails on CPU although the docs allow it is left out of schedules/ops/ and
kept in tests/op_known_failures/, expected to fail until it is fixed.
"""

from __future__ import annotations

import enum
import typing
import zlib
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from support.gallery import CALLS, header, worlds

from dcpc import pipeline
from dcpc.check.when import local as runs_alone
from dcpc.codegen.plan import StepPlan
from dcpc.diagnostics import DiagnosticError
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.worker import returned_names
from dcpc.lang import model as m
from dcpc.lang.mesh import mesh_of
from dcpc.lang.parse import parse_file
from dcpc.lang.semantics import table
from dcpc.ops import OPS

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "schedules" / "ops").glob("*.yaml"))
KNOWN = sorted((ROOT / "tests" / "op_known_failures").glob("*.yaml"))
KERNELS = {p.name.removesuffix(".py.j2") for p in (ROOT / "templates" / "ops").glob("*.py.j2")}
PROGRAMS = 2  # per launch in every run world but the first of several, which runs one
# program per launch looping over all the tiles (and costs less CPU)


def first_world(path: Path) -> Any:
    return worlds(header(path, "run") or "")[0]


@cache
def schedule_of(path: Path, world: Any) -> m.Schedule:
    return parse_file(path, world)  # a hop loop unrolls per W


def maxima(schedule: m.Schedule) -> dict[str, int]:
    """Every per-call size at the maximum the file declares (a mesh axis' size comes
    from the world's shape; a multiple is bound at construction by the harness)."""
    axes = set(mesh_of(schedule).size_names()) if schedule.mesh else set()
    return {name: spec.max for name, spec in schedule.sizes.items()
            if isinstance(spec, m.SizeSpec) and spec.max is not None
            and spec.multiple_of is None and name not in axes}


def test_every_file_states_its_claims() -> None:
    assert FILES
    names = set()
    for path in FILES:
        for key in ("op", "check", "run"):
            assert header(path, key), f"{path.name} has no '# {key}:' header"
        claimed, run = worlds(header(path, "check") or ""), worlds(header(path, "run") or "")
        assert set(run) <= set(claimed), f"{path.name} runs worlds it does not prove"
        schedule = schedule_of(path, run[0])
        assert schedule.doc, f"{path.name} has no doc: say which kernel path it covers"
        kinds = {s.kind for s in schedule.step_list()}
        for op in (header(path, "op") or "").split():
            assert op in OPS, f"{path.name}: '# op: {op}' names no op"
            assert op in kinds, f"{path.name}: no step of its op {op}"
        names.add(schedule.schedule)
    assert len(names) == len(FILES), "two files share a schedule name"


def test_every_op_has_a_file() -> None:
    """A new op without a file here fails; an op that emits no kernel (no template under
    templates/ops/: `external`) still appears as a step."""
    assert KERNELS <= set(OPS), KERNELS - set(OPS)
    claimed = {op for p in FILES for op in (header(p, "op") or "").split()}
    used = {s.kind for p in FILES for s in schedule_of(p, first_world(p)).step_list()}
    for op in OPS:
        if op in KERNELS:
            assert op in claimed, f"op {op} has no file in schedules/ops/ ('# op: {op}')"
        else:
            assert op in used, f"op {op} is used by no file in schedules/ops/"


def _choices(annotation: Any) -> set[Any]:
    """The values of the Literals and Enums in a field's annotation (not the op tag)."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {member.value for member in annotation}
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    return set().union(*(_choices(a) for a in typing.get_args(annotation)))


def _nodes(annotation: Any) -> list[type[BaseModel]]:
    """The models nested in a field's annotation (MaskEmpty, Scale)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [n for a in typing.get_args(annotation) for n in _nodes(a)]


def _keys(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, annotation) of a model's keys, nested ones included; not marks,
    free text or the op tag."""
    for name, f in model.model_fields.items():
        if name in ("op", "doc") or (f.alias or "").startswith("__"):
            continue
        yield prefix + name, f.annotation
        for node in _nodes(f.annotation):
            yield from _keys(node, f"{prefix}{name}.")


def _given(node: BaseModel, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every key a step sets."""
    for name in node.model_fields_set:
        value = getattr(node, name)
        yield prefix + name, value.value if isinstance(value, enum.Enum) else value
        if isinstance(value, BaseModel):
            yield from _given(value, f"{prefix}{name}.")


# keys a model takes that the checker refuses on that op (a file could not set them),
# each refusal with its own test: none now (`group` on an all_to_all was, 9f82130)
REFUSED: set[tuple[str, str]] = set()


def test_every_key_and_value_of_every_op_is_exercised() -> None:
    """Every key of every op's model (`axis` on the ops that take a team) is set by some
    step, `when` on the ops that run on their rank alone, and every value of its
    enumerations (reduce, phase, to, from, lse_base, per, the named offsets) taken: a new
    key or value without a file fails here."""
    seen: set[tuple[str, str, Any]] = set()
    local: set[str] = set()  # the ops that run on their rank alone: the ones when: guards
    for path in FILES:
        schedule = schedule_of(path, first_world(path))
        for step, sem in zip(schedule.step_list(), table(schedule), strict=True):
            if runs_alone(sem):
                local.add(step.kind)
            for key, value in _given(step.op):
                seen.add((step.kind, key, None))
                if isinstance(value, str | int):
                    seen.add((step.kind, key, value))
    missing = []
    for op, d in OPS.items():
        for key, annotation in _keys(d.model):
            if (key == "axis" and not d.teams) or (key == "when" and op not in local):
                continue
            if (op, key) in REFUSED:
                continue
            missing += [f"{op}.{key}"] if (op, key, None) not in seen else []
            missing += [f"{op}.{key}: {v}" for v in sorted(_choices(annotation), key=str)
                        if (op, key, v) not in seen]
    assert not missing, "no file in schedules/ops/ sets: " + "; ".join(missing)


# Kernel variants: one per path through a template (its attrs, constexprs and branches)
# that a key alone does not name. Left out, as tests/op_known_failures/ says why: a
# dequantise into bf16 (ragged_all_to_all.py.j2's bf16_out rounding).
Variant = Callable[[m.Schedule, m.Step, StepPlan, Any], bool]


def _merge(op: str, **attrs: Any) -> Variant:
    def match(schedule: m.Schedule, step: m.Step, plan: StepPlan, world: Any) -> bool:
        return step.kind == op and getattr(step.op, "reduce", "lse") == "lse" and all(
            plan.attrs.get(k) == v for k, v in attrs.items())
    return match


def _cast(op: str, mode: int) -> Variant:
    return lambda s, step, plan, w: step.kind == op and plan.attrs.get("cast") == mode


MERGES = ("lse_combine", "lse_correct", "all_to_all_combine", "all_reduce")  # math.j2's merge
MERGE_ATTRS = {  # its paths: the kernels' MASK, INTERLEAVE, BASE2, RETURN_LSE, SCALE
    "local lengths": {"mask": True, "mask_interleave": 0}, "unmasked": {"mask": False},
    "base 2": {"base": "2"}, "return_lse": {"return_lse": True}, "fp8": {"scale": True},
}


def _interleaved(op: str, least: int) -> Variant:
    return lambda s, step, plan, w: (step.kind == op and plan.attrs.get("mask")
                                     and plan.attrs.get("mask_interleave", 0) >= least)


def _team(op: str) -> Variant:
    return lambda s, step, plan, w: step.kind == op and plan.sync.axes is not None


def _payloads(plan: StepPlan) -> list[tuple[str, bool]]:
    return plan.attrs.get("payloads", [])


VARIANTS: dict[str, Variant] = {
    "all_gather: concat": lambda s, step, p, w: step.kind == "all_gather" and any(
        not stack for _, stack in _payloads(p)),
    "all_gather: stack": lambda s, step, p, w: step.kind == "all_gather" and any(
        stack for _, stack in _payloads(p)),
    "all_gather: several payloads": lambda s, step, p, w: (step.kind == "all_gather"
                                                           and len(_payloads(p)) > 1),
    "all_gather: phase put (push, no wait)": lambda s, step, p, w: (
        step.kind == "all_gather" and p.attrs.get("wait") is False),
    "all_gather: phase wait (its put's grid)": lambda s, step, p, w: (
        step.kind == "all_gather" and p.attrs.get("signal") is False),
    "all_to_all: stack": lambda s, step, p, w: (p.template == "ops/all_to_all.py.j2"
                                                and not p.attrs.get("concat")),
    "all_to_all: several payloads": lambda s, step, p, w: (
        p.template == "ops/all_to_all.py.j2" and p.attrs.get("payloads", 0) > 1),
    "all_to_all: split_dim/concat_dim": lambda s, step, p, w: bool(p.attrs.get("concat")),
    "all_to_all: phase put (push, no wait)": lambda s, step, p, w: (
        step.kind == "all_to_all" and p.attrs.get("wait") is False),
    "all_to_all: phase wait (its put's grid)": lambda s, step, p, w: (
        step.kind == "all_to_all" and p.attrs.get("signal") is False),
    "all_to_all: split_dim/concat_dim over a team": lambda s, step, p, w: bool(
        p.attrs.get("concat")) and p.sync.axes is not None,
    **{f"all_to_all: cast {k}": _cast("all_to_all", k) for k in (1, 2, 3, 4)},
    **{f"ragged_all_to_all: cast {k}": _cast("ragged_all_to_all", k) for k in (0, 1, 2, 3, 4)},
    "ragged_all_to_all: over a team": _team("ragged_all_to_all"),
    **{f"{op}: cast {k} per G channels": lambda s, step, p, w, op=op, k=k: (
        step.kind == op and p.attrs.get("cast") == k and bool(p.attrs.get("group")))
       for op in ("ragged_all_to_all", "all_to_all") for k in (1, 3)},
    **{f"{op}: cast 1 by a DeepEP rule, {tile}": lambda s, step, p, w, op=op, tile=tile: (
        step.kind == op and p.attrs.get("cast") == 1 and bool(p.attrs.get("rule"))
        and bool(p.attrs.get("tile")) == (tile == "per G channels"))
       for op in ("ragged_all_to_all", "all_to_all") for tile in ("per G channels", "per row")},
    "ragged_all_to_all: several payloads, the first cast": lambda s, step, p, w: (
        step.kind == "ragged_all_to_all" and p.attrs.get("payloads", 1) > 1
        and p.attrs.get("cast") == 1),
    "ragged_all_to_all: several payloads, uncast": lambda s, step, p, w: (
        step.kind == "ragged_all_to_all" and p.attrs.get("payloads", 1) > 1
        and p.attrs.get("cast") == 0),
    **{f"ragged_all_to_all: groups, {way}": lambda s, step, p, w, way=way: (
        step.kind == "ragged_all_to_all" and p.attrs.get("groups") == way)
       for way in ("dispatch", "combine")},
    "ragged_all_to_all: phase put (push, no wait)": lambda s, step, p, w: (
        step.kind == "ragged_all_to_all" and p.attrs.get("wait") is False),
    "ragged_all_to_all: phase wait (its own kernel)": lambda s, step, p, w: (
        step.kind == "ragged_all_to_all" and p.attrs.get("signal") is False),
    "ragged_all_to_all: per-token cast over a team": lambda s, step, p, w: (
        step.kind == "ragged_all_to_all" and p.attrs.get("cast") == 1
        and p.sync.axes is not None),
    "all_to_all: cast over a team": lambda s, step, p, w: (
        step.kind == "all_to_all" and bool(p.attrs.get("cast")) and p.sync.axes is not None),
    **{f"{op}: {name}": _merge(op, **attrs) for op in MERGES for name, attrs in MERGE_ATTRS.items()
       if (op, name) != ("lse_correct", "fp8")},  # lse_correct has no output_scale
    **{f"{op}: full lengths": _interleaved(op, 1) for op in MERGES},
    **{f"{op}: a KV interleave": _interleaved(op, 2) for op in MERGES},
    "all_to_all_combine: own part from src": _merge("all_to_all_combine", self_copy=False),
    "all_to_all_combine: own part through via": _merge("all_to_all_combine", self_copy=True),
    "pull: stack": lambda s, step, p, w: step.kind == "pull" and not p.attrs.get("form"),
    "pull: concat of a split dim": lambda s, step, p, w: p.attrs.get("form") == "concat",
    "pull: reduce of a split dim": lambda s, step, p, w: p.attrs.get("form") == "reduce",
    "pull: a split dim over a team": lambda s, step, p, w: (bool(p.attrs.get("form"))
                                                          and p.sync.axes is not None),
    "reduce_scatter: implicit via": lambda s, step, p, w: (step.kind == "reduce_scatter"
                                                          and step.op.via is None),
    "reduce_scatter: fp8": lambda s, step, p, w: (step.kind == "reduce_scatter"
                                                  and p.attrs.get("scale")),
    "reduce_scatter: phase put (push, no sum)": lambda s, step, p, w: (
        step.kind == "reduce_scatter" and p.attrs.get("wait") is False),
    "reduce_scatter: phase wait (the sum, its put's grid)": lambda s, step, p, w: (
        step.kind == "reduce_scatter" and p.attrs.get("signal") is False),
    "all_reduce: implicit via": lambda s, step, p, w: (step.kind == "all_reduce"
                                                      and step.op.via is None),
    "all_reduce: lse over a team": lambda s, step, p, w: (
        step.kind == "all_reduce" and step.op.reduce == "lse" and p.sync.axes is not None),
    "reduce: implicit via": lambda s, step, p, w: step.kind == "reduce" and step.op.via is None,
    "reduce: root 0": lambda s, step, p, w: step.kind == "reduce" and step.op.root == 0,
    "reduce: another root": lambda s, step, p, w: step.kind == "reduce" and step.op.root > 0,
    "broadcast: root 0": lambda s, step, p, w: step.kind == "broadcast" and step.op.root == 0,
    "broadcast: another root": lambda s, step, p, w: (step.kind == "broadcast"
                                                     and step.op.root > 0),
    "weighted_combine: dense": lambda s, step, p, w: (step.kind == "weighted_combine"
                                                     and step.op.index is None),
    "shift: put and wait in one kernel": lambda s, step, p, w: (step.kind == "shift"
                                                               and step.op.phase is None),
    "shift: a local copy (W divides the offset)": lambda s, step, p, w: (
        step.kind == "shift" and p.attrs["offset"] % int(w) == 0),
    "shift: past the next rank": lambda s, step, p, w: (
        step.kind == "shift" and p.attrs["offset"] % int(w) not in (0, 1, int(w) - 1)),
    "shift: in a hop loop": lambda s, step, p, w: (step.kind == "shift"
                                                  and s.loop_world is not None),
    "shift: perm, a fixed point (a local copy on that rank)": lambda s, step, p, w: (
        step.kind == "shift" and any(d == r for r, d in enumerate(p.attrs.get("perm", [])))),
    "shift: perm, partial (a rank that is no source)": lambda s, step, p, w: (
        step.kind == "shift" and -1 in p.attrs.get("perm", [])),
    "shift: perm, split in put and wait": lambda s, step, p, w: (
        step.kind == "shift" and "perm" in p.attrs and step.op.phase == "put"),
    **{f"{op}: one peer by {how}": (lambda s, step, p, w, op=op, key=key: (
        step.kind == op and p.attrs.get(key) is not None))
       for op in ("signal", "wait") for how, key in (("an offset", "peer_k"),
                                                     ("a perm's table", "peer_of"))},
    **{f"{op}: over a team": _team(op) for op, d in OPS.items() if d.teams},
}


def test_every_kernel_variant_is_lowered() -> None:
    """Each variant of VARIANTS is lowered by some file at one of its run worlds."""
    found: set[str] = set()
    for path in FILES:
        for world in worlds(header(path, "run") or ""):
            c = pipeline.run(path, pipeline.Options(worlds=[world]), until="lower")
            assert c.schedule is not None and c.plan is not None
            steps = {s.name: s for s in c.schedule.step_list()}
            for plan in c.plan.steps:
                found |= {name for name, match in VARIANTS.items()
                          if match(c.schedule, steps[plan.name], plan, world)}
    assert set(VARIANTS) <= found, f"no file lowers: {sorted(set(VARIANTS) - found)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_op_schedule_is_proved_for_every_world_it_claims(path: Path) -> None:
    c = pipeline.run(path, pipeline.Options(worlds=worlds(header(path, "check") or "")),
                     until="hb")
    assert c.schedule is not None


def run_on_cpu(path: Path, world: Any) -> None:
    """Run ``path`` on the host backend against float64 and assert every returned buffer
    was compared on every rank in every call."""
    schedule = schedule_of(path, world)
    seed = zlib.crc32(f"{path.stem}/{world}".encode()) % 10_000
    claimed = worlds(header(path, "run") or "")
    programs = 1 if len(claimed) > 1 and world == claimed[0] else PROGRAMS
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend="host",
                                    calls=CALLS, seed=seed, programs=programs,
                                    sizes=maxima(schedule)))
    text = format_report(report)
    print(text)
    assert report.launch.ok, text + "\n" + "\n".join(o.traceback for o in report.launch.outcomes)
    assert report.mismatches == 0, text
    for names in returned_names(schedule, world).values():
        for name in names:
            # on every rank in every call, but where the reference left it as it was
            stats = report.outputs[name]
            assert stats.compared + stats.kept >= CALLS * int(world), (name, text)
            assert stats.compared > 0, (name, text)


RUNS = [(p, w) for p in FILES for w in worlds(header(p, "run") or "")]


@pytest.mark.e2e
@pytest.mark.parametrize(("path", "world"), RUNS, ids=lambda v: getattr(v, "stem", str(v)))
def test_op_schedule_matches_float64(path: Path, world: Any) -> None:
    run_on_cpu(path, world)


@pytest.mark.e2e
@pytest.mark.parametrize("path", [
    pytest.param(p, id=p.stem, marks=pytest.mark.xfail(
        strict=True, raises=(AssertionError, DiagnosticError), reason=header(p, "known")))
    for p in KNOWN])
def test_known_failure_still_fails(path: Path) -> None:
    """A variant the docs allow that fails here, why in its `# known:` header: proved for
    its `# check:` worlds and matching float64 at its `# run:` worlds is what it should
    do. When it does (strict: the test then fails), move it into schedules/ops/."""
    pipeline.run(path, pipeline.Options(worlds=worlds(header(path, "check") or "")),
                 until="hb")
    for world in worlds(header(path, "run") or ""):
        run_on_cpu(path, world)
