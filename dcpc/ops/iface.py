"""What an op's rules are handed, typed below the ops.

An op's verifier (``OpDef.verify``) gets the check stage's ``Verify`` (dcpc.check.ops),
its float64 reference (``OpDef.reference``) the simulator's ``Sim``
(dcpc.harness.simulate), its Triton lowering (``OpDef.lower``) the lowering's ``Ctx``
(dcpc.codegen.ctx). Those stages sit above the ops and import them; the ops see
them only through the protocols here (what they actually use of each), so that no op
imports a stage, not even for a type. ``Ref`` lives here because ops build them too,
the ``InputRule``s an op's ``OpDef.inputs`` returns (dcpc.harness.synth reads them) and
the ``OutputRule``s of its ``OpDef.outputs`` (dcpc.harness.worker reads them); an
op's own torch body (``OpDef.torch``) gets a ``TorchComm`` (the runtime's slot group).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dcpc.diagnostics import Mark

if TYPE_CHECKING:
    import torch

    from dcpc.lang import expr as ex
    from dcpc.lang.nodes import Buffer, MaskEmpty, ScheduleView, Step


@dataclass
class Ref:
    """A buffer named by a step: the name, the role it plays and where it is written."""

    name: str
    role: str
    mark: Mark


# What ``dcpc run``'s synthetic inputs must respect in a buffer an op reads: an op's
# ``OpDef.inputs`` names them, dcpc.harness.synth makes the values (an engine input, or
# what an engine step writes). A buffer no op names gets random values (integers 0..99).


@dataclass(frozen=True)
class Counts:
    """Row counts: integers in 0..``capacity`` (a size expression), whoever writes them."""

    capacity: str


@dataclass(frozen=True)
class RowIndex:
    """The index buffer's [T, K] row numbers into ``rows`` seen as [rows, H]: rows that
    exist, or -1 (an empty slot); of a ``rows`` [W, capacity, H] whose capacity is that of
    a ``Counts`` buffer the engine passes, only rows ``[0, counts[j])`` of block j (of
    rows placed by an index on a round trip, the rows it placed: dcpc.harness.synth)."""

    rows: str


@dataclass(frozen=True)
class Placement:
    """A ragged move's ``index`` (src's [slots * capacity] rows): the rows of its slot each
    row lands at, distinct within a slot (two rows at one row race, in DeepEP too) and in
    [0, ``capacity``) (a size expression); a move's src that lands in it is drawn so too
    (DeepEP's src_info: the token indices a rank sends one expert, each once)."""

    capacity: str


@dataclass(frozen=True)
class TensorScale:
    """A per-tensor fp8 scale [1]: a positive normal, small enough that some values
    saturate the fp8 buffer among ``between`` (the buffers it scales from and into)."""

    between: tuple[str, ...] = ()


@dataclass(frozen=True)
class Requests:
    """A buffer of the request mask ``mask`` (its lengths or query_start_loc), whose rows
    are the leading dim of ``rows`` (``T``, ``B*T``, ...)."""

    mask: MaskEmpty
    rows: str


InputRule = Counts | RowIndex | Placement | TensorScale | Requests


# What ``dcpc run`` compares of a buffer an op writes: an op's ``OpDef.outputs`` names
# the buffers with a rule (dcpc.harness.worker reads them); a buffer no op names is
# compared whole.


@dataclass(frozen=True)
class Unsent:
    """Elements no rank sent may stay as they were (the rows past a count of a ragged
    exchange): the float64 reference holds ``SimView.unsent`` there (NaN, or an integer
    payload's poison) and says which they are (``SimView.store``'s ``unsent`` mask), and
    ``dcpc run`` compares every other element (a NaN a rank sent too)."""


OutputRule = Unsent


class Samples(Protocol):
    """What a verifier reads of the check's sampled bindings (dcpc.lang.questions)."""

    @property
    def worlds(self) -> Sequence[int]: ...


class CheckContext(Protocol):
    """What a verifier reads of the check context (dcpc.check.context.Context)."""

    @property
    def schedule(self) -> ScheduleView: ...

    @property
    def samples(self) -> Samples: ...

    @property
    def semantics(self) -> Sequence[Any]: ...  # each step's Semantics, by step index

    @property
    def channels(self) -> Any: ...  # which signal each wait polls (common.Channels), once


class ShapeRules(Protocol):
    """The shared shape, dtype and base rules bound to one step and the check context:
    what ``OpDef.verify`` is handed (dcpc.check.ops.Verify implements it)."""

    @property
    def step(self) -> Step: ...

    @property
    def ctx(self) -> CheckContext: ...

    @property
    def W(self) -> ex.Expr: ...  # noqa: N802  (the op's team size G; W without a mesh)

    def refs(self, key: str) -> list[Ref]: ...

    def shape(self, name: str) -> list[ex.Expr] | None: ...

    def buffer(self, name: str) -> Buffer | None: ...

    def error(self, mark: Mark, code: str, message: str, hint: str | None = None) -> None: ...

    def dim(self, ref: Ref, rank: int) -> int | None: ...

    def expect(self, ref: Ref, want: list[ex.Expr], why: str) -> None: ...

    def part(self, ref: Ref) -> list[ex.Expr] | None: ...

    def part_along(self, ref: Ref, dim: int) -> list[ex.Expr] | None: ...

    def same_dtype(self, src: Ref, dst: Ref) -> None: ...

    def transfer(self, src: Ref, dst: Ref, *, symmetric: bool) -> None: ...

    def pairs(self, srcs: list[Ref], dsts: list[Ref]) -> list[tuple[Ref, Ref]]: ...

    def scatter(self, src: Ref, recv: Ref) -> list[ex.Expr] | None: ...

    def merge(self, o: Ref, lse: Ref, *, stacked: bool) -> None: ...


Store = Callable[[int, str, "torch.Tensor"], None]  # (rank, buffer, value)


class SimView(Protocol):
    """One simulated call, as an op's float64 reference reads and writes it: what
    ``OpDef.reference`` is handed (dcpc.harness.simulate.Sim implements it)."""

    @property
    def schedule(self) -> ScheduleView: ...

    @property
    def world(self) -> int: ...

    @property
    def bufs(self) -> list[dict[str, torch.Tensor]]: ...  # float64 (int64 for integers)

    @property
    def external(self) -> Callable[[Step, int, dict[str, torch.Tensor]],
                                   Mapping[str, torch.Tensor]]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def store(self, rank: int, name: str, value: torch.Tensor, *,
              unsent: torch.Tensor | None = None) -> None: ...  # unsent: elements no rank sent

    def stash(self, rank: int, name: str, value: torch.Tensor, *, like: str) -> None: ...

    def unsent(self, name: str) -> torch.Tensor: ...  # "never written", in name's shape

    def unsent_mask(self, rank: int, name: str) -> torch.Tensor: ...  # unwritten this call

    def all_to_all(self, src: str, dst: str, dim: int, store: Store | None = None) -> None: ...

    def merge_weights(self, op: Any, rank: int, lse_name: str
                      ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def weighted_sum(self, weights: torch.Tensor, parts: torch.Tensor) -> torch.Tensor: ...

    # value, scaled into fp8 by the op's output_scale (unchanged without one); err: a
    # bound of the kernel's fp32 error of value (fp32_error or merge_error), from which
    # the interval dcpc run accepts the kernel's fp8 byte in is made
    def scaled(self, op: Any, rank: int, value: torch.Tensor, err: torch.Tensor
               ) -> torch.Tensor: ...

    # a bound of the fp32 error of a sum of ``terms`` products whose magnitudes add up
    # to ``magnitude`` (0 terms: computed exactly, a max)
    def fp32_error(self, terms: int, magnitude: torch.Tensor | float) -> torch.Tensor: ...

    # a bound of the fp32 error of an LSE merge sum_p w_p o_p (only = r: of w_r o_r alone,
    # parts then o_r)
    def merge_error(self, weights: torch.Tensor, parts: torch.Tensor,
                    only: int | None = None) -> torch.Tensor: ...


class LowerRules(Protocol):
    """The lowering context, as an op's Triton rule uses it: what ``OpDef.lower`` is
    handed (dcpc.codegen.ctx.Ctx implements it). A rule returns its step's plan, a
    ``dcpc.codegen.plan.StepPlan`` made by ``plan`` (``Any`` here: the plan sits above
    the ops); its template is templates/ops/<op>.py.j2. Buffers are
    ``dcpc.codegen.plan.BufferPlan``s: ``.shape``, ``.dtype``, ``.kind`` (engine,
    symmetric, shared, output), ``.lse_base``."""

    @property
    def schedule(self) -> ScheduleView: ...

    @property
    def buffers(self) -> Mapping[str, Any]: ...

    def shape(self, name: str) -> list[ex.Expr]: ...

    def engine(self, names: Iterable[str | None]) -> list[str]: ...

    def base(self, op: Any, lse: str) -> str: ...

    def team_w(self, step: Step) -> ex.Expr: ...

    def fail(self, mark: Mark, code: str, message: str, hint: str | None = None) -> None: ...

    def plan(self, step: Step, **fields: Any) -> Any: ...

    def add_buffer(self, name: str, shape: list[ex.Expr], dtype: str, kind: str) -> None: ...

    def layout(self, plan: Any, role: str, a: int, b: int, unit: bool = False) -> None: ...

    def mask(self, op: Any, plan: Any) -> None: ...

    def output_scale(self, op: Any, plan: Any) -> None: ...


class TorchComm(Protocol):
    """One slot's process group, as an op's own torch body (``OpDef.torch``) uses it
    (dcpc.runtime.collectives.SlotGroup implements it). The body is copied into each
    generated module that has the op (the runtime imports no compiler code), so it
    reaches the runtime only through this: ``group`` (a torch.distributed group),
    ``rank`` (this rank's index in it: a team member index for a team op), and the
    helpers below."""

    @property
    def group(self) -> Any: ...

    @property
    def rank(self) -> int: ...

    def wait(self, work: Any, op: str) -> None: ...  # an async collective, within the timeout

    def wire(self, t: torch.Tensor) -> torch.Tensor: ...  # as sent: an fp8 tensor as bytes

    def refuse(self, message: str) -> None: ...  # bad arguments: DcpcArgumentError
