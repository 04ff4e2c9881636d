"""Order within a call: reads of buffers nothing wrote, and signal/wait channels."""

from __future__ import annotations

from dataclasses import dataclass, replace

from dcpc.check.context import Context, Ref
from dcpc.diagnostics import did_you_mean
from dcpc.lang import when as wh
from dcpc.lang.mesh import mesh_of
from dcpc.lang.model import Step
from dcpc.lang.semantics import READ, Region, effect_mark
from dcpc.ops.common import data_flow
from dcpc.ops.sync import Signal
from dcpc.topology import shape_of, torus


@dataclass(frozen=True)
class Access:
    """One buffer access of a step, where the data flow places it.

    ``step``: whose effect it is; ``at``: the step it happens at in the data flow (for a
    store in flight, ``Effect.lands``: the step whose wait lands it, else ``step``);
    ``root``: the team member it happens on (None: every rank)."""

    step: Step
    at: Step
    mode: str  # "r" | "w"
    ref: Ref
    root: int | None = None
    everywhere: bool = True  # False: a store some ranks' instances never get (Region.line)
    region: Region | None = None  # a remote store's (Region.target: where it lands)

    @property
    def scheme(self) -> str | None:
        """A remote store's ``Region.scheme`` (``line``, ``perm``, ...), else None."""
        return self.region.scheme if self.region is not None else None


def accesses(ctx: Context) -> list[Access]:
    """Every buffer access of the call in the order the data flow has them
    (dcpc.lang.semantics: the one definition of what an op reads and writes, and when;
    ``data_flow``: a store in flight at the step whose wait lands it)."""
    out = []
    for i, e in data_flow(ctx.semantics):
        step = ctx.steps[i]
        at = step if e.lands is None else ctx.steps[e.lands]
        ref = Ref(e.buffer, e.key or "implicit", effect_mark(step, e))
        out.append(Access(step, at, "r" if e.kind == READ else "w", ref, e.root,
                          e.region is None or e.region.covers_all, e.region))
    return out


def check_reads(ctx: Context) -> None:
    """A symmetric buffer is read only after a step of the call wrote it, on every rank
    that reads it (a reduce writes its via on the root only), and not while a store into
    it is still in flight (a shift's data lands at its wait); an engine-owned buffer is
    not read before the step that writes it (one that no step writes is an input)."""
    _check_views(ctx)
    # a buffer used whole and by slice is its slices here: a whole read needs each
    # slice written (the missing one is named), a whole write writes each
    found = [replace(a, ref=Ref(cell, a.ref.role, a.ref.mark)) if cell != a.ref.name else a
             for a in accesses(ctx) for cell in ctx.schedule.cells(a.ref.name)]
    # a persistent buffer's read before the call writes it reads what the previous call
    # left (zeros at call 0): the happens-before checker orders it after that write
    persistent = {n for n, b in ctx.schedule.buffers.items() if b.persist}
    _persistent_reads(ctx, [a for a in found if a.ref.name in persistent], found)
    found = [a for a in found if a.mode == "w" or a.ref.name not in persistent]
    guarded = {s.index for s in wh.guarded(ctx.schedule)}
    # a buffer a guarded step writes is written on the ranks where its guard holds, and
    # one a guarded step reads is read there only: their reads are checked rank by rank
    # (exact), not by the SPMD rules below
    written = {a.ref.name for a in found if a.mode == "w"}  # what no step writes: an input
    exact = {a.ref.name for a in found if a.step.index in guarded} & written
    if exact:
        _check_per_rank(ctx, [a for a in found if a.ref.name in exact], found)
        found = [a for a in found if a.ref.name not in exact]
    first_writer: dict[str, Access] = {}
    for acc in found:
        if acc.mode == "w":
            first_writer.setdefault(acc.ref.name, acc)
    everywhere: set[str] = set()  # written on every rank
    roots: dict[str, set[int]] = {}  # written on these team members only
    reported: set[str] = set()
    partial: dict[str, Access] = {}  # written on some ranks only: the first such store
    for acc in found:
        step, ref = acc.step, acc.ref
        buffer = ctx.buffer(ref.name)
        if acc.mode == "w":
            if acc.root is None and acc.everywhere:
                everywhere.add(ref.name)
            elif acc.root is not None:
                roots.setdefault(ref.name, set()).add(acc.root)
            else:  # on some ranks only (a shift without wrap)
                partial.setdefault(ref.name, acc)
            continue
        if buffer is None or ref.name in everywhere or ref.name in reported:
            continue
        if acc.root is not None and acc.root in roots.get(ref.name, ()):
            continue
        writer = first_writer.get(ref.name)
        if writer is not None and writer.step is step and writer.at is step \
                and not buffer.is_symmetric:
            continue  # an engine buffer read and written by one step: an in-place update
            # (a symmetric one is the module's: nothing wrote it before this call's step)
        if buffer.is_symmetric and ref.name in partial:
            reported.add(ref.name)
            w = partial[ref.name].step
            ctx.error(ref.mark, "read-before-write",
                      f"step '{step.name}' reads symmetric buffer '{ref.name}' on every "
                      f"rank, but the earlier steps of the call write it on some ranks only "
                      + (f"({w.kind} '{w.name}' has a perm in which some ranks are no "
                         "destination: they receive nothing)"
                         if getattr(w.op, "perm", None) is not None else
                         f"({w.kind} '{w.name}' has no wrap: the ranks with no source at "
                         "the end of the line receive nothing)")
                      + ", so those ranks read what nothing wrote",
                      hint=f"write '{ref.name}' on every rank before '{w.name}', or read "
                      "it after the call, where the ranks that received know it")
        elif buffer.is_symmetric:
            reported.add(ref.name)
            _unwritten(ctx, acc, writer, roots.get(ref.name, set()))
        elif writer is not None and writer.at.index > step.index:
            reported.add(ref.name)
            ctx.error(ref.mark, "read-before-write",
                      f"step '{step.name}' reads '{ref.name}' before step "
                      f"'{writer.step.name}' writes it",
                      hint=f"move step '{step.name}' after '{writer.at.name}'")


def _persistent_reads(ctx: Context, found: list[Access], every: list[Access]) -> None:
    """A persistent buffer read on rank r needs a step that writes it there, in some call:
    one that runs on r (its when: holds) whose store reaches r (a shift without wrap
    reaches the ranks with a source only), at every W checked; else rank r's instance
    holds its initial zeros in every call. One that no step writes at all is named so,
    if symmetric (a local one is the engine's then: names.py's persist-engine-owned).
    ``every``: all the call's accesses (a push reads its source only where it sends)."""
    written = {a.ref.name for a in found if a.mode == "w"}
    reported: set[str] = set()
    for name in dict.fromkeys(a.ref.name for a in found if a.ref.name not in written
                              and ctx.schedule.buffers[a.ref.name].is_symmetric):
        reported.add(name)
        read = next(a for a in found if a.ref.name == name)
        ctx.error(read.ref.mark, "read-before-write",
                  f"step '{read.step.name}' reads persistent buffer '{name}', but no step "
                  "writes it: it holds its initial zeros in every call",
                  hint=f"write '{name}' in a step (what it writes carries to the next "
                  "call), or drop 'persist: true'")
    for world in ctx.samples.worlds:
        running = wh.running(ctx.schedule, world)
        silent = _silent_pushes(ctx, every, world)
        for rank in range(int(world)):
            for read in found:
                name = read.ref.name
                if read.mode != "r" or name in reported or name not in written \
                        or not _runs(running, read, rank) \
                        or read.step.index in silent.get(rank, ()):
                    continue
                writes = [a for a in found if a.mode == "w" and a.ref.name == name]
                made = [a for a in writes if _runs(running, a, rank)]
                if any(_reaches(ctx, a, rank, world) for a in made):
                    continue
                reported.add(name)
                why = "; ".join(
                    [f"'{_decides(a).name}'{_landing(a)} does not run there (its when: does "
                     "not hold)"
                     for a in writes if a not in made] +
                    [f"the store of '{a.step.name}' does not reach it ({_why_not(a, rank)})"
                     for a in made])
                ctx.error(read.ref.mark, "read-before-write",
                          f"step '{read.step.name}' reads persistent buffer '{name}' on rank "
                          f"{rank} at W={world}, but no step writes it there: {why}, so it "
                          "holds its initial zeros in every call there",
                          hint=f"guard '{read.step.name}' to the ranks where '{name}' is "
                          f"written, or write '{name}' on every rank that reads it")


def _runs(running: dict[int, frozenset[int]], acc: Access, rank: int) -> bool:
    """Whether ``acc`` happens on ``rank`` (``running``: dcpc.lang.when.running's): a
    store where it lands there, at its own step or at the receiver's wait (a split
    put and its wait, guarded apart: dcpc.check.when proved the put ran on the sender
    wherever the wait runs); any other access where its step runs."""
    ranks = running.get(_decides(acc).index)
    return ranks is None or rank in ranks


def _decides(acc: Access) -> Step:
    """The step whose ``when:`` decides whether ``acc`` happens on a rank (``_runs``)."""
    return acc.at if acc.mode == "w" else acc.step


def _landing(acc: Access) -> str:
    """Said after ``_decides``'s name when it is a split wait, not the storing step."""
    return "" if _decides(acc) is acc.step else \
        f" (the wait where the store of '{acc.step.name}' lands)"


def _check_views(ctx: Context) -> None:
    """A buffer used whole and by slice is the engine's tensor and its views: a method
    (a step that is not external) that writes it or a slice would make that one the
    module's own memory (dcpc.codegen.lower: a method's output), no view of the engine's
    tensor, so the other side would never see the write (mixed-index)."""
    slices = ctx.schedule.slices
    reported: set[str] = set()
    for acc in accesses(ctx):
        part = ctx.schedule.slice_of(acc.ref.name)
        whole = part[0] if part else acc.ref.name if acc.ref.name in slices else None
        if acc.mode != "w" or whole is None or acc.step.kind == "external" \
                or whole in reported or _module_view(ctx, whole, part):
            continue
        reported.add(whole)
        shown = f"slice '{ctx.schedule.slice_text(acc.ref.name)}'" if part else f"'{whole}'"
        ctx.error(acc.ref.mark, "mixed-index",
                  f"step '{acc.step.name}' ({acc.step.kind}) writes {shown}, and '{whole}' "
                  "is used both whole and by slice: its slices are views of the engine's "
                  "tensor, but what a method writes is the module's own buffer, so the "
                  "whole and its slices would not be one memory",
                  hint=f"write '{whole}' and its slices in engine steps only, or copy "
                  "into a buffer of its own")


def _module_view(ctx: Context, whole: str, part: tuple[str, int] | None) -> bool:
    """A method's write of ``whole``, a buffer in the module's symmetric memory (a slot
    whose chunks external steps read, ``b[s][:, i]``): its slices are views of that
    memory, so the write is one of theirs too (a method never takes a slice of it:
    ``bad-index`` at the unrolling)."""
    return part is None and any(
        ctx.schedule.module_view_of(cell) == whole for cell in ctx.schedule.cells(whole))


def _check_per_rank(ctx: Context, found: list[Access], every: list[Access]) -> None:
    """The reads of buffers that guarded steps write, rank by rank at every W checked: a
    read on rank r needs an earlier write on rank r by a step that runs there (a guarded
    one whose condition holds at r, or a store every rank gets). ``every``: all the
    call's accesses (a push's source is read only where its store goes anywhere)."""
    reported: set[str] = set()
    silent = {int(w): _silent_pushes(ctx, every, w) for w in ctx.samples.worlds}
    for world in ctx.samples.worlds:
        running = wh.running(ctx.schedule, world)

        for rank in range(int(world)):
            written: set[str] = set()
            for acc in found:
                name = acc.ref.name
                if name in reported or not _runs(running, acc, rank):
                    continue
                if acc.mode == "w":
                    if _reaches(ctx, acc, rank, world):
                        written.add(name)
                    continue
                if acc.root is not None and not _on_root(ctx, acc, rank, world):
                    continue  # a read on the root only (a reduce's via): not this rank
                if acc.step.index in silent[int(world)].get(rank, ()):
                    continue  # its push reads its source where it sends: not on this rank
                buffer = ctx.buffer(name)
                if name in written or (buffer is not None and not buffer.is_symmetric and any(
                        a.step is acc.step and a.mode == "w" and a.ref.name == name
                        for a in found)):
                    continue  # written before here, or an engine buffer updated in place
                reported.add(name)
                # made before the read, or landed before it (a wait written before its
                # put: the chain, whose store lands at the wait)
                earlier = [a for a in found if a.mode == "w" and a.ref.name == name
                           and min(a.step.index, a.at.index) < acc.step.index]
                skipped = [_decides(a).name + _landing(a) for a in earlier
                           if not _runs(running, a, rank)]
                made = [a for a in earlier if _runs(running, a, rank)]
                # a store that would reach this rank but lands at a wait after the read
                flight = [a for a in made if _reaches(ctx, a, rank, world)
                          and a.at.index > acc.step.index]
                missed = [a for a in made if a not in flight]
                chained = [a for a in missed if a.at.index < a.step.index]
                missed = [a for a in missed if a not in chained]
                why = "; ".join(
                    ([f"the earlier steps that write it do not run there (their when: does "
                      f"not hold): {', '.join(skipped)}"] if skipped else []) +
                    [f"the data of '{a.step.name}' is in flight until its wait "
                     f"'{a.at.name}', after '{acc.step.name}'" for a in flight] +
                    ([f"the stores of {', '.join(a.step.name for a in missed)} do not reach "
                      f"it there ({'; '.join(dict.fromkeys(_why_not(a, rank) for a in missed))}"
                      ")"] if missed else []) +
                    [f"'{a.step.name}' stores it at its wait '{a.at.name}' (a wait written "
                     f"before its put: the chain), but rank {rank} receives nothing at "
                     f"W={world} ({_why_not(a, rank)})" for a in chained])
                why = "; " + (why or "no earlier step writes it")
                part = ctx.schedule.slice_of(name)
                shown = (f"'{ctx.schedule.slice_text(name)}' ('{name}')" if part
                         else f"'{name}'")
                hint = (f"move step '{acc.step.name}' after '{flight[0].at.name}'" if flight
                        and not skipped and not missed else
                        f"guard '{acc.step.name}' by the condition of the step that "
                        f"writes '{name}', or write '{name}' on every rank that reads it")
                ctx.error(acc.ref.mark, "read-before-write",
                          f"step '{acc.step.name}' reads {shown} on rank {rank} at W="
                          f"{world}, where nothing the call ran before wrote it{why}",
                          hint=hint)


def _reaches(ctx: Context, store: Access, rank: int, world: int) -> bool:
    """Whether ``store`` writes ``rank``'s instance in the per-rank data flow: a root's
    on the root (without a mesh: team = group); a shift's without wrap or by a perm where
    ``Region.target`` lands one of its writers' stores (a line's: on the ranks with a
    source; a perm's: on its destinations); any other partial store on none (sound)."""
    region = store.region
    return (store.root is None and store.everywhere) or (
        store.root is not None and _on_root(ctx, store, rank, world)) or (
        region is not None and region.scheme in ("line", "perm")
        and _lands_on(region, rank, world))


def _on_root(ctx: Context, acc: Access, rank: int, world: int) -> bool:
    """Whether ``rank`` is the root of ``acc`` (a team member index: of the whole group
    without a mesh, of the rank's team along the step's axes on one)."""
    if ctx.schedule.mesh is None:
        return acc.root == rank
    axes = mesh_of(ctx.schedule).team_axes(acc.step.op)
    return torus(shape_of(world)).team(rank, axes).index(rank) == acc.root


def _lands_on(region: Region, rank: int, world: int) -> bool:
    """Whether some rank's store of a ``line`` or ``perm`` region lands on ``rank``'s
    instance: one of the writers the ring gives it (``Region.writers``) whose store
    ``Region.target`` lands there (a perm's table of another size than W: none)."""
    topo = torus(shape_of(world))
    if region.scheme == "perm" and len(region.table) != topo.size:
        return False
    return any(region.target(p, topo) == rank for p in region.writers(rank, world))


def _why_not(store: Access, rank: int) -> str:
    """Why ``store`` (one that runs on ``rank``) does not write ``rank``'s instance."""
    if store.scheme == "perm":
        return f"a perm in which rank {rank} is no destination"
    if store.scheme == "line":
        return "a shift without wrap: no source on that side of the line"
    if store.root is not None:
        return f"a root's store (root {store.root})"
    return "a store that does not reach every rank"


def _silent_pushes(ctx: Context, found: list[Access], world: int) -> dict[int, set[int]]:
    """rank -> the indices of the steps whose store from that rank reaches no rank (a
    perm's -1, a shift without wrap past the end of the line): such a rank makes no
    push, so it reads none of the step's sources (the brute force and the template
    agree): where ``Region.target`` says its store lands nowhere."""
    topo = torus(shape_of(world))
    out: dict[int, set[int]] = {}
    for acc in found:
        region = acc.region
        if acc.mode != "w" or acc.root is not None or region is None or \
                region.scheme not in ("line", "perm") or len(region.table) not in (0, world):
            continue
        for rank in range(world):
            if region.target(rank, topo) is None:
                out.setdefault(rank, set()).add(acc.step.index)
    return out


def _unwritten(ctx: Context, read: Access, writer: Access | None, roots: set[int]) -> None:
    """The read-before-write error of a symmetric buffer: nothing wrote it on some rank
    that reads it (``roots``: the team members whose instance was written)."""
    step, name = read.step, read.ref.name
    # a slot's chunk (b[s][:, i]) as the file writes it too
    shown = (f"'{ctx.schedule.slice_text(name)}' ('{name}')"
             if ctx.schedule.slice_of(name) else f"'{name}'")
    if roots and writer is not None:
        root_writer = next(a for a in accesses(ctx) if a.mode == "w" and a.ref.name == name
                           and a.root is not None and a.at.index <= step.index)
        w = root_writer.step
        on = ", ".join(str(r) for r in sorted(roots))
        dst = getattr(w.op, "dst", None)
        instead = f"read '{dst}' (what '{w.name}' computes) instead, or " if dst else ""
        ctx.error(read.ref.mark, "read-before-write",
                  f"step '{step.name}' reads symmetric buffer {shown} on every rank, but "
                  f"the earlier steps of the call write it on the root only ({w.kind} "
                  f"'{w.name}', root {on}), so the other ranks read what nothing wrote",
                  hint=f"{instead}write '{name}' on every rank before '{w.name}'")
        return
    if writer is not None and writer.at is not writer.step \
            and writer.step.index < step.index < writer.at.index:
        ctx.error(read.ref.mark, "read-before-write",
                  f"step '{step.name}' reads symmetric buffer {shown}, but no earlier step "
                  f"of the call writes it: the data of '{writer.step.name}' is in flight "
                  f"until its wait '{writer.at.name}', after '{step.name}'",
                  hint=f"move step '{step.name}' after '{writer.at.name}'")
        return
    in_place = writer is not None and writer.step is step
    ctx.error(read.ref.mark, "read-before-write",
              f"step '{step.name}' reads symmetric buffer {shown}, but no "
              "earlier step of the call writes it"
              + (" (it updates it in place: the module's buffer holds nothing this call "
                 "wrote)" if in_place else ""),
              hint=f"move step '{writer.at.name}' before '{step.name}'"
              if writer and not in_place
              else "write it in an earlier step, or make it engine-owned "
              "(drop 'symmetric: true') so the engine passes it in")


def check_channels(ctx: Context) -> None:
    """Every wait polls one signal step whose peers reach it; every signal is polled."""
    found = ctx.channels
    for err in found.errors:
        op = err.step.op
        mark = op.mark(err.key) if err.key and err.key in op.src_marks else err.step.mark()
        hint = err.hint
        if err.code == "unmatched-wait" and hint is None:
            names = {s.op.channel for s in ctx.steps if isinstance(s.op, Signal)}
            hint = did_you_mean(op.channel, names) or (  # type: ignore[attr-defined]
                f"add a step '{{op: signal, channel: {op.channel}}}' before it")  # type: ignore[attr-defined]
        ctx.error(mark, err.code, err.message, hint=hint,
                  severity="warning" if err.code == "unmatched-signal" else "error")
