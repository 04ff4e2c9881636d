"""The combine and gather runners the adapters call, and their torch fallback.

A runner owns one generated module instance (built collectively on first use, or at
model load by ``MLADCPManager``; the table of those built is dcpc.engines.runners) and
makes its calls in the contract's order:

- combine, a2a / fused: the exchange and merge, then ``release`` (a barrier), issued
  lazily at the start of the slot's next call: it closes the previous call (no peer
  may write this rank's receive buffers before every rank merged) without stalling
  the stream right after the merge;
- combine, ag_rs: ``lse_gather``, ``correct`` (fp32), ``out_scatter`` (fp32 sum,
  rounded once): the next call's gathers already order the reuse;
- gather (query, KV): ``gather`` then, lazily, ``release``.

Empty shards and padding rows (vLLM's ``seq_lens``/``query_start_loc``) are masked at
the source: this rank's LSE gets -inf where vLLM's mask_dcp_empty_shards_ would put it
(a few small torch ops, out of place). With ``DCPC_KERNEL_MASK=1`` the kernels mask
instead, after a first ``lens_gather`` step shares every rank's local lengths.

Module buffers are fixed at construction: a call with more tokens or requests than
the workspace, or that a module cannot take, runs ``torch_combine`` instead (the same
math over torch.distributed, or over the threads of a dcpc LocalGroup).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dcpc.engines import capture, runners
from dcpc.engines.agree import agree, explain, forget, refusing
from dcpc.engines.call_ids import current_call_id, name_call
from dcpc.engines.common import (
    DTYPE_NAMES,
    CombineSpec,
    GatherSpec,
    Group,
    log_once,
    module_class,
    switch,
)
from dcpc.engines.fallback import Comm, mask_at_source, torch_combine
from dcpc.runtime.errors import DcpcArgumentError, DcpcContractError
from dcpc.runtime.validate import axis_strides

TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


# ---- inputs a module method accepts ------------------------------------------------------
def fit_layout(cls: type, method: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when ``method`` can read it with its strides (the module's LAYOUTS:
    strided engine inputs), else a contiguous copy: never a layout error mid-call."""
    for arg, a, b, unit in cls.LAYOUTS.get(method, ()):
        if arg == name:
            _, why = axis_strides(t.shape, t.stride(), a, b, unit)
            return t if why is None else t.contiguous()
    return t.contiguous()


# ---- debugging views kept too long -------------------------------------------------------
def debug_views() -> bool:
    """``DCPC_DEBUG_VIEWS=1``: results are copies, poisoned (NaN) at the slot's next call,
    and the module's own result buffers are poisoned once copied: an engine that keeps
    a result past the next call (as it may keep a view) sees NaN at once. Eager only:
    every call allocates (no CUDA-graph capture)."""
    return switch("DCPC_DEBUG_VIEWS") == "on"


class HandedOut:
    """What a runner handed out per slot, for DCPC_DEBUG_VIEWS."""

    def __init__(self, slots: int):
        self.last: list[list[torch.Tensor]] = [[] for _ in range(slots)]

    def out(self, slot: int, got: tuple) -> tuple:
        """``got`` itself, or (debug) copies of it, after poisoning the last call's."""
        for kept in self.last[slot]:
            kept.fill_(float("nan"))
        self.last[slot] = []
        if not debug_views():
            return got
        copies = tuple(None if t is None else t.clone() for t in got)
        for view, copy in zip(got, copies, strict=True):
            if view is not None:
                view.fill_(float("nan"))  # the module's buffer: nothing reads it until
                self.last[slot].append(copy)  # this rank's next call rewrites it
        return copies


# ---- the runners --------------------------------------------------------------------------
class CombineRunner:
    """One combine module on one group; ``run`` returns (out [T, H/W, Dv], lse of this
    rank's heads [T, H/W] f32), views of the module's buffers (valid until the slot's
    next call)."""

    def __init__(self, spec: CombineSpec, group: Group, heads: int, backend: str):
        self.spec, self.group, self.heads = spec, group, heads
        self.cls = module_class(spec, group.world)
        self.module = self.cls(group.handle, sizes={"H": heads}, device=group.device,
                               backend=backend)
        self.pending = [False] * spec.slots  # a call whose release() is still due
        self.handed = HandedOut(spec.slots)

    def fits(self, tokens: int, reqs: int | None) -> bool:
        """Within the workspace (sizes fixed at construction)."""
        s = self.spec
        return tokens <= s.max_tokens and (reqs is None or 1 <= reqs <= s.max_reqs)

    def run(self, o: torch.Tensor, lse: torch.Tensor, lens: torch.Tensor | None,
            qsl: torch.Tensor | None, slot: int = 0, scale: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One call: ``lens`` (this rank's local KV lengths [B] i32) and ``qsl`` when the
        spec masks, ``scale`` ([1] f32) when its output is fp8."""
        cid = current_call_id()  # one id for every method of the call (dcpc.engines.call_ids)
        try:
            got = self._run(o, lse, lens, qsl, slot, scale, cid)
        except DcpcContractError as err:
            raise explain(name_call(err)) from err
        return self.handed.out(slot, got)  # type: ignore[return-value]

    def skip(self, slot: int = 0) -> None:
        """This rank takes the fallback for this call: an empty call (T = 0) through the
        module keeps the ranks' epochs in step, and a peer that ran the kernel fails with
        a contract error on both ranks (dcpc.engines.agree)."""
        s, dev = self.spec, self.group.device
        o = torch.zeros(0, self.heads, s.dv, dtype=TORCH_DTYPES[s.o_dtype], device=dev)
        lse = torch.zeros(0, self.heads, dtype=torch.float32, device=dev)
        lens = torch.zeros(1, dtype=torch.int32, device=dev) if s.mask else None
        qsl = torch.zeros(2, dtype=torch.int32, device=dev) if s.mask else None
        scale = (torch.ones(1, dtype=torch.float32, device=dev)
                 if s.out_dtype == "fp8e4m3" else None)
        self.run(o, lse, lens, qsl, slot, scale)

    mark = skip  # refuse's empty call

    def _run(self, o: torch.Tensor, lse: torch.Tensor, lens: torch.Tensor | None,
             qsl: torch.Tensor | None, slot: int, scale: torch.Tensor | None,
             cid: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.pending[slot]:
            self.module.release(slot=slot, call_id=cid)
            self.pending[slot] = False
        if self.spec.mask:
            self.module.lens_gather(lens, slot=slot, call_id=cid)
        masked = [qsl] if self.spec.mask else []
        extra = [] if scale is None else [scale]
        if self.spec.path == "ag_rs":
            return self._ag_rs(o, lse, masked, extra, slot, cid)
        got = self._exchange(o, lse, masked, extra, slot, cid)
        self.pending[slot] = True
        return (got[0], got[1]) if self.spec.return_lse else (got, None)

    def _exchange(self, o: torch.Tensor, lse: torch.Tensor, masked: list, extra: list,
                  slot: int, cid: int | None) -> Any:
        m, cls = self.module, self.cls
        if self.spec.path == "fused":
            return m.combine(fit_layout(cls, "combine", "o_part", o),
                             fit_layout(cls, "combine", "lse_part", lse),
                             *masked, *extra, slot=slot, call_id=cid)
        m.out_exchange(fit_layout(cls, "out_exchange", "o_part", o),
                       fit_layout(cls, "out_exchange", "lse_part", lse), slot=slot,
                       call_id=cid)
        return m.merge(*masked, *extra, slot=slot, call_id=cid)

    def _ag_rs(self, o: torch.Tensor, lse: torch.Tensor, masked: list, extra: list,
               slot: int, cid: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        m, cls = self.module, self.cls
        m.lse_gather(fit_layout(cls, "lse_gather", "lse_part", lse), slot=slot, call_id=cid)
        corrected = m.correct(fit_layout(cls, "correct", "o_part", o), *masked, slot=slot,
                              call_id=cid)
        out = m.out_scatter(*extra, slot=slot, call_id=cid)
        if not self.spec.return_lse:
            return out, None
        part, r = self.heads // self.group.world, self.group.rank
        return out, corrected[1][:, r * part:(r + 1) * part]  # the merged LSE of all heads


class GatherRunner:
    """One gather module: ``run(rows)`` returns the gathered rows (a view, valid until
    the slot's next call: the next call's release waits for every rank's read)."""

    def __init__(self, spec: GatherSpec, group: Group, heads: int | None, backend: str):
        self.spec, self.group = spec, group
        self.cls = module_class(spec, group.world)
        sizes = {"H": heads} if spec.kind == "q" else {}
        self.heads = heads
        self.module = self.cls(group.handle, sizes=sizes, device=group.device, backend=backend)
        self.pending = [False] * spec.slots
        self.handed = HandedOut(spec.slots)

    def fits(self, tokens: int) -> bool:
        return tokens <= self.spec.max_tokens

    def run(self, rows: torch.Tensor, slot: int = 0) -> torch.Tensor:
        cid = current_call_id()
        try:
            if self.pending[slot]:
                self.module.release(slot=slot, call_id=cid)
            self.pending[slot] = True
            got = self.module.gather(rows.contiguous(), slot=slot, call_id=cid)
        except DcpcContractError as err:
            raise explain(name_call(err)) from err
        return self.handed.out(slot, (got,))[0]

    def skip(self, rows: torch.Tensor, slot: int = 0) -> None:
        """This rank takes the fallback for ``rows``: an empty call (T = 0), as
        CombineRunner.skip."""
        self.run(rows[:0], slot)

    def mark(self, slot: int = 0) -> None:
        """refuse's empty call (query gathers: [0, H/W, D])."""
        s, w = self.spec, self.group.world
        self.run(torch.zeros(0, (self.heads or w) // w, s.d, dtype=TORCH_DTYPES[s.dtype],
                             device=self.group.device), slot)


def reset(group: Any = None) -> int:
    """Close the modules the adapters built on this rank and forget them (and the agreed
    settings): the way out of the failed state after an error (a timeout, a contract
    error). ``group``: only those of this DCP group (a GroupCoordinator, a ProcessGroup
    or a LocalRank: ranks that are threads of one process pass theirs); None: all.
    Collective: every rank of the group calls it at the same point of its calls,
    outside CUDA-graph capture (graphs captured before hold the old modules: capture
    again). The next call of each function builds fresh modules, collectively as the
    first did. Returns the number of modules closed on this rank."""
    handles = None if group is None else {id(h) for h in (
        group, getattr(group, "device_group", None), getattr(group, "cpu_group", None))
        if h is not None}
    closed = runners.close(handles)
    forget(handles)
    capture.forget(handles)  # new modules: their first calls warm up again
    return closed


def combine_settings(switch_name: str, max_tokens: int, backend: str) -> dict[str, Any]:
    """What picks a combine's path, agreed by every rank (dcpc.engines.agree)."""
    return {switch_name: switch(switch_name), "DCPC_KERNEL_MASK": kernel_mask(),
            "workspace tokens": max_tokens, "backend": backend}


def check_mask_args(seq_lens: Any, query_start_loc: Any) -> bool:
    """Both or neither, 1-D, ``query_start_loc`` one longer than ``seq_lens`` (vLLM's
    checks in mask_dcp_empty_shards_): True when the empty-shard mask applies."""
    if (seq_lens is None) != (query_start_loc is None):
        raise DcpcArgumentError("seq_lens and query_start_loc must be given together "
                                "(the empty-shard mask needs both), or neither")
    if seq_lens is None:
        return False
    if seq_lens.dim() != 1 or query_start_loc.dim() != 1:
        raise DcpcArgumentError(f"seq_lens {tuple(seq_lens.shape)} and query_start_loc "
                                f"{tuple(query_start_loc.shape)} must be 1-D")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise DcpcArgumentError(f"query_start_loc has {query_start_loc.shape[0]} entries, "
                                f"expected len(seq_lens) + 1 = {seq_lens.shape[0] + 1}")
    return True


# ---- one combine call, dcpc or fallback ---------------------------------------------------
class EngineResult:
    """What the engine's own function returned (a fallback through it), as it returned
    it: the adapter passes it on unchanged."""

    def __init__(self, value: Any):
        self.value = value


def combine_call(path: str, out: torch.Tensor, lse: torch.Tensor, group: Group, *,
                 base2: bool, seq_lens: torch.Tensor | None, qsl: torch.Tensor | None,
                 switch_name: str, max_tokens: int, slots: int = 1, slot: int = 0,
                 instance: int = 0, backend: str = "auto", label: str = "dcpc",
                 engine: Callable[[], Any] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | EngineResult:
    """(out [T, H/W, D] in out's dtype, G of this rank's heads [T, H/W] f32) for one
    combine: through a dcpc module when the switch, dtypes and workspace allow it,
    else through ``engine()`` (the engine's own function, saved by ``install``; its
    result wrapped in EngineResult) or, without one, ``torch_combine``; either fallback
    is logged once per reason. ``seq_lens`` are THIS rank's local KV lengths [B]
    (None: no mask)."""
    settings = combine_settings(switch_name, max_tokens, backend)
    with refusing(group, out, label, lambda: settings):  # every rank raises, or none
        check_tensors(label, out=out, lse=lse)
        if out.dim() != 3:
            raise DcpcArgumentError(f"{label}: the output has shape {tuple(out.shape)}, "
                                    "expected [T, H, D]")
        tokens, heads, dv = out.shape
        if lse.shape != (tokens, heads):
            raise DcpcArgumentError(f"{label}: LSE has shape {tuple(lse.shape)}, expected "
                                    f"{(tokens, heads)} for an output of shape "
                                    f"{tuple(out.shape)}")
        if heads % group.world:
            raise DcpcArgumentError(f"{label}: {heads} heads do not split over "
                                    f"{group.world} ranks (H % W != 0)")
    mode = settings[switch_name]
    agree(group, label, settings, Comm(group).all_gather)
    why = _unsupported(out, lse)
    kind = "dtype"  # the log key: one warning per kind of reason, not per token count
    if mode == "on" and why:
        raise DcpcArgumentError(f"{label}: {switch_name}=1 but {why}")
    in_kernel = seq_lens is not None and kernel_mask()
    if mode != "off" and not why:
        dtype = DTYPE_NAMES[out.dtype]
        spec = CombineSpec(path, dv, o_dtype=dtype, out_dtype=dtype,
                           lse_base="2" if base2 else "e", max_tokens=max_tokens,
                           max_reqs=max_tokens, slots=slots, mask=in_kernel)
        r = runners.runner(CombineRunner, spec, group, heads, backend, instance)
        runners.used(group, label, r, slot, instance)
        reqs = None if seq_lens is None or not in_kernel else seq_lens.shape[0]
        if r.fits(tokens, reqs):
            if seq_lens is not None and not in_kernel:  # vLLM's mask, out of place
                return r.run(out, mask_at_source(lse.float(), seq_lens, qsl), None, None,
                             slot)
            lens = None if seq_lens is None else seq_lens.to(torch.int32).contiguous()
            q = None if qsl is None else qsl.to(torch.int32).contiguous()
            return r.run(out, lse if lse.dtype == torch.float32 else lse.float(), lens, q, slot)
        r.skip(slot)  # the fallback on every rank, or a contract error on every rank
        many = f"{tokens} tokens" + ("" if reqs is None else f" / {reqs} requests")
        kind = "empty" if reqs == 0 else "workspace"
        why = ("no requests (B = 0): every row is masked" if reqs == 0 else
               f"{many} exceed the workspace ({max_tokens}), fixed at construction")
    if mode == "off":
        kind, why = "off", f"{switch_name}=0"
    if engine is not None:
        log_once(f"{label}:{kind}:engine", f"{label}: the engine's own path: {why} (logged "
                 "once per kind of reason)")
        return EngineResult(engine())
    if mode != "off":
        log_once(f"{label}:{kind}", f"{label}: torch fallback: {why} (logged once per kind "
                 "of reason)")
    lse32 = lse.float() if qsl is None else mask_at_source(lse.float(), seq_lens, qsl)
    return torch_combine(Comm(group), path, out, lse32, base2, out.dtype)


def kernel_mask() -> bool:
    """``DCPC_KERNEL_MASK=1``: mask empty shards in-kernel (a ``lens_gather`` step shares
    every rank's local lengths; ``mask_empty: {local_seq_lens}``) instead of at the
    source. Both are correct on CPU and on one H200 (W = 2, 3); the source mask stays
    the default until their latencies are compared."""
    return switch("DCPC_KERNEL_MASK") == "on"


def check_tensors(label: str, **tensors: torch.Tensor | None) -> None:
    """Refuse what no path can take: a meta tensor (no data), an integer or bool output
    or LSE (the fallback would merge it as a float, silently)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type == "meta":
            raise DcpcArgumentError(f"{label}: {name} is a meta tensor (no data); pass "
                                    "a CPU or CUDA tensor")
        if name in ("out", "lse") and not t.dtype.is_floating_point:
            raise DcpcArgumentError(f"{label}: {name} has dtype {t.dtype}; the partial "
                                    "output and its LSE must be floats (LSE: f32, bf16, f16)")


def _unsupported(out: torch.Tensor, lse: torch.Tensor) -> str:
    """Why no dcpc module takes these inputs ("" when one does)."""
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the partial output dtype {out.dtype} is not bf16, f16 or f32"
    if lse.dtype == torch.float8_e4m3fn:
        return f"the LSE dtype {lse.dtype} is fp8"
    if out.device.type not in ("cuda", "cpu"):
        return f"device {out.device} is neither CUDA nor CPU"
    return ""
