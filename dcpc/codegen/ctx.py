"""The lowering context ``Ctx``, which every op's Triton rule (``OpDef.lower`` in
dcpc/ops/<op>.py) is handed, and the launch defaults the driver dcpc/codegen/lower.py
applies.

The ops see ``Ctx`` only through the ``LowerRules`` protocol of dcpc.ops.iface (they
sit below this stage and never import it); it makes their ``StepPlan``s for them and
holds what several rules do (``layout``, ``mask``, ``output_scale``). The shape-AST
builders the rules use (``W``, ``ONE``, ``product``, ``div``) are dcpc.lang.expr's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dcpc.codegen.plan import BufferPlan, Expr, StepPlan
from dcpc.diagnostics import Diagnostic, Mark
from dcpc.lang import model as m
from dcpc.lang.expr import ONE, product
from dcpc.lang.mesh import mesh_of

# Launch defaults, from benchmarks/tune_gpu.py on 2xH200 (benchmarks/results/tuning.md):
# 4 warps, 4096-element tiles (2048 for the fused exchange+merge), at most 128 programs;
# a call with fewer tiles than that gets shorter tiles and fewer programs
# (dcpc.runtime.module.ScheduleModule._launch). Both slots' kernels must be co-resident
# (a program spins on its peer's twin): 2 x 128 programs of 4 warps fit an H200 (132
# SMs) several times over, and two slots on two streams at 128 ran clean on 2xH200.
DEFAULT_TUNING = {"programs": 128, "num_warps": 4, "block": 4096}
SYNC_TUNING = {"programs": 1, "num_warps": 1, "block": 1}  # one signal/poll, one program
OP_TUNING = {"all_to_all_combine": {"block": 2048},
             "barrier": SYNC_TUNING, "signal": SYNC_TUNING, "wait": SYNC_TUNING}


class Ctx:
    """What a rule may look at and use: the schedule, its buffers (as plans) and its
    steps; dcpc.ops.iface.LowerRules is the part the ops' rules see."""

    def __init__(self, schedule: m.Schedule, buffers: dict[str, BufferPlan]):
        self.schedule = schedule
        self.buffers = buffers
        self.steps = schedule.step_list()
        self.errors: list[Diagnostic] = []

    def shape(self, name: str) -> list[Expr]:
        return self.buffers[name].shape

    def engine(self, names: Iterable[str | None]) -> list[str]:
        """The engine-owned buffers among ``names``: a method's arguments."""
        out: list[str] = []
        for n in names:
            if n is not None and self.buffers[n].kind == "engine" and n not in out:
                out.append(n)
        return out

    def base(self, op: Any, lse: str) -> str:
        return getattr(op, "lse_base", None) or self.buffers[lse].lse_base or "e"

    def team_w(self, step: m.Step) -> Expr:
        """The size of a step's team (dcpc.lang.mesh): what a team op splits its parts by."""
        return mesh_of(self.schedule).team_size(step.op)

    def fail(self, mark: Mark, code: str, message: str, hint: str | None = None) -> None:
        self.errors.append(Diagnostic(mark, code, message, hint))

    def plan(self, step: m.Step, **fields: Any) -> StepPlan:
        """A new plan of ``step`` with ``fields`` set; its template is the op's
        (templates/ops/<op>.py.j2) unless ``template`` says another (None: external)."""
        template = fields.pop("template", f"ops/{step.kind}.py.j2")
        return StepPlan(step.name, step.index, step.kind, template, step.op.doc, **fields)

    def add_buffer(self, name: str, shape: list[Expr], dtype: str, kind: str) -> None:
        """A buffer the module owns that the schedule does not name (an implicit ``via``)."""
        self.buffers[name] = BufferPlan(name, shape, dtype, kind)

    def layout(self, plan: StepPlan, role: str, a: int, b: int, unit: bool = False) -> None:
        """The kernel addresses ``role``'s buffer as axes dims[:a], dims[a:b], dims[b:], one
        stride each. An engine buffer's strides come from the tensor passed in (checked and
        read once per call by dcpc.runtime.validate); a module-owned one's are packed."""
        plan.layouts[role] = (a, b, unit)
        name = plan.roles[role]
        if self.buffers[name].kind != "engine":
            shape = self.shape(name)
            plan.scalars += [
                (f"{role}_s0", product(shape[a:])),
                (f"{role}_s1", product(shape[b:])),
                (f"{role}_s2", ONE),
            ]

    def mask(self, op: Any, plan: StepPlan) -> None:
        """Roles, scalars and statics of ``mask_empty`` (empty shards and padding rows)."""
        mask = op.mask_empty
        plan.attrs["mask"] = mask is not None
        # the kernels' INTERLEAVE: >= 1 for full lengths, 0 for local ones ([B, W])
        local = mask is not None and mask.local_seq_lens is not None
        plan.attrs["mask_interleave"] = 0 if local else (mask.interleave if mask else 1)
        if mask is None:
            return
        plan.roles["seq_lens"], plan.roles["query_start_loc"] = mask.lengths, mask.query_start_loc
        plan.params += [n for n in self.engine([mask.lengths, mask.query_start_loc])]
        plan.scalars.append(("batch", self.shape(mask.lengths)[0]))
        plan.statics["batch"] = self.shape(mask.lengths)[0]

    def output_scale(self, op: Any, plan: StepPlan) -> None:
        """``output_scale``: dst = clamp(out / scale[0]) (an fp8 output)."""
        scale = getattr(op, "output_scale", None)
        plan.attrs["scale"] = scale is not None
        if scale is not None:
            plan.roles["out_scale"] = scale
            plan.params += [n for n in self.engine([scale]) if n not in plan.params]

