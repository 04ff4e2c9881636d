"""The combine and gather runners the adapters call, and their torch fallback.

A runner owns one generated module instance (built collectively on first use, or at
model load by ``MLADCPManager``) and makes its calls in the contract's order:

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

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dcpc.engines.common import (
    DTYPE_NAMES,
    CombineSpec,
    GatherSpec,
    Group,
    log_once,
    module_class,
    switch,
)
from dcpc.runtime.collectives import wire
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.local import LocalRank, sync_stream
from dcpc.runtime.validate import axis_strides

NEG_INF = float("-inf")


# ---- inputs a module method accepts ------------------------------------------------------
def fit_layout(cls: type, method: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when ``method`` can read it with its strides (the module's LAYOUTS:
    strided engine inputs), else a contiguous copy: never a layout error mid-call."""
    for arg, a, b, unit in cls.LAYOUTS.get(method, ()):
        if arg == name:
            _, why = axis_strides(t.shape, t.stride(), a, b, unit)
            return t if why is None else t.contiguous()
    return t.contiguous()


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

    def fits(self, tokens: int, reqs: int | None) -> bool:
        """Within the workspace (sizes fixed at construction)."""
        s = self.spec
        return tokens <= s.max_tokens and (reqs is None or 1 <= reqs <= s.max_reqs)

    def run(self, o: torch.Tensor, lse: torch.Tensor, lens: torch.Tensor | None,
            qsl: torch.Tensor | None, slot: int = 0, scale: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One call: ``lens`` (this rank's local KV lengths [B] i32) and ``qsl`` when the
        spec masks, ``scale`` ([1] f32) when its output is fp8."""
        if self.pending[slot]:
            self.module.release(slot=slot)
            self.pending[slot] = False
        if self.spec.mask:
            self.module.lens_gather(lens, slot=slot)
        masked = [qsl] if self.spec.mask else []
        extra = [] if scale is None else [scale]
        if self.spec.path == "ag_rs":
            return self._ag_rs(o, lse, masked, extra, slot)
        got = self._exchange(o, lse, masked, extra, slot)
        self.pending[slot] = True
        return (got[0], got[1]) if self.spec.return_lse else (got, None)

    def _exchange(self, o: torch.Tensor, lse: torch.Tensor, masked: list, extra: list,
                  slot: int) -> Any:
        m, cls = self.module, self.cls
        if self.spec.path == "fused":
            return m.combine(fit_layout(cls, "combine", "o_part", o),
                             fit_layout(cls, "combine", "lse_part", lse),
                             *masked, *extra, slot=slot)
        m.out_exchange(fit_layout(cls, "out_exchange", "o_part", o),
                       fit_layout(cls, "out_exchange", "lse_part", lse), slot=slot)
        return m.merge(*masked, *extra, slot=slot)

    def _ag_rs(self, o: torch.Tensor, lse: torch.Tensor, masked: list, extra: list,
               slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        m, cls = self.module, self.cls
        m.lse_gather(fit_layout(cls, "lse_gather", "lse_part", lse), slot=slot)
        corrected = m.correct(fit_layout(cls, "correct", "o_part", o), *masked, slot=slot)
        out = m.out_scatter(*extra, slot=slot)
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
        self.module = self.cls(group.handle, sizes=sizes, device=group.device, backend=backend)
        self.pending = [False] * spec.slots

    def fits(self, tokens: int) -> bool:
        return tokens <= self.spec.max_tokens

    def run(self, rows: torch.Tensor, slot: int = 0) -> torch.Tensor:
        if self.pending[slot]:
            self.module.release(slot=slot)
        self.pending[slot] = True
        return self.module.gather(rows.contiguous(), slot=slot)


_runners: dict[tuple, Any] = {}
_runners_lock = threading.Lock()


def runner(kind: type, spec: CombineSpec | GatherSpec, group: Group, heads: int | None,
           backend: str, instance: int = 0) -> Any:
    """The cached runner for (group, device, spec, heads, backend, instance); built
    (collectively: every rank reaches the same call) the first time. ``instance``: one
    module per microbatch for callers that have no slot to pass. The key holds the group
    handle's id, and the runner a reference to it, so the id is not reused while cached."""
    key = (id(group.handle), str(group.device), spec, heads, backend, group.rank, instance)
    with _runners_lock:
        found = _runners.get(key)
    if found is None:
        found = kind(spec, group, heads, backend)
        with _runners_lock:
            _runners.setdefault(key, found)
    return found


# ---- collectives for the fallback ---------------------------------------------------------
_exchanges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Comm:
    """all_gather / all_to_all over the group, for the torch fallback: torch.distributed
    for a ProcessGroup, a shared table and the group's barrier for a dcpc LocalRank."""

    def __init__(self, group: Group):
        self.group = group

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[W, *t.shape]: every rank's ``t`` in rank order."""
        t = t.contiguous()
        if self.group.world == 1:
            return t.unsqueeze(0)
        if isinstance(self.group.handle, LocalRank):
            return torch.stack(self._local([t] * self.group.world))
        out = torch.empty(self.group.world * t.numel(), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(wire(out), wire(t.reshape(-1)), group=self.group.handle)
        return out.view(self.group.world, *t.shape)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [W, ...]: part j goes to rank j; returns [W, ...] with rank p's part at p."""
        t = t.contiguous()
        if self.group.world == 1:
            return t.clone()
        if isinstance(self.group.handle, LocalRank):
            return torch.stack(self._local(list(t.unbind(0))))
        out = torch.empty_like(t)
        dist.all_to_all_single(wire(out), wire(t), group=self.group.handle)
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.all_gather(t).sum(0, dtype=t.dtype)

    def _local(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Threads of a LocalGroup: rank r posts part j for rank j, all arrive, each
        takes what was posted for it, all arrive again (the table is then reused)."""
        rank: LocalRank = self.group.handle
        table = _exchanges.setdefault(rank.group, {})
        table[rank.rank] = [p.clone() for p in parts]
        rank.barrier()  # syncs this stream first: the clones are done before a peer reads
        got = [table[p][rank.rank].clone() for p in range(rank.world)]
        sync_stream(parts[0].device)  # read before the owner frees or reposts its clones
        rank.group.barrier()
        return got


# ---- the math, in torch (fp32) ------------------------------------------------------------
def mask_at_source(lse: torch.Tensor, seq_lens: torch.Tensor,
                   qsl: torch.Tensor) -> torch.Tensor:
    """vLLM's mask_dcp_empty_shards_, out of place: rows at or past qsl[-1] and rows of
    requests with this rank's local length 0 get -inf (every row when B is 0)."""
    tokens, batch = lse.shape[0], seq_lens.shape[0]
    if batch == 0:
        return torch.full_like(lse, NEG_INF)
    rows = torch.arange(tokens, device=lse.device, dtype=qsl.dtype)
    req = torch.searchsorted(qsl[1:].contiguous(), rows, right=True).clamp(max=batch - 1)
    dead = (rows >= qsl[-1]) | (seq_lens[req] == 0)
    return lse.masked_fill(dead.reshape(-1, *([1] * (lse.dim() - 1))), NEG_INF)


def _exp_log(base2: bool) -> tuple:
    return (torch.exp2, torch.log2) if base2 else (torch.exp, torch.log)


def merged(lses: torch.Tensor, base2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sanitized lses [N, ...], global LSE [...]): NaN/+inf count as -inf; an all -inf
    row gives -inf."""
    exp, log = _exp_log(base2)
    lses = lses.float()
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), NEG_INF, lses)
    m = lses.amax(0)
    m = torch.where(m == NEG_INF, 0.0, m)
    return lses, log(exp(lses - m).sum(0)) + m


def correct(out: torch.Tensor, lses: torch.Tensor, rank: int, base2: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's correct_attn_out in fp32: (out * exp(lse_rank - G), 0 where the weight is
    0 (NaN partials of empty shards included); G [B, H])."""
    exp, _ = _exp_log(base2)
    lses, total = merged(lses, base2)
    d = lses[rank] - total
    d = torch.where(torch.isnan(d) | (d == float("inf")), NEG_INF, d)
    f = exp(d).unsqueeze(-1)
    return torch.where(f == 0, 0.0, out.float() * f), total


def torch_combine(comm: Comm, path: str, o: torch.Tensor, lse: torch.Tensor, base2: bool,
                  out_dtype: torch.dtype, all_heads: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine over torch collectives (LSE already masked at the source):
    (out [B, H/W, D] in ``out_dtype``, G of this rank's heads [B, H/W] f32); with
    ``all_heads`` (vLLM's cp_lse_ag_out_ar) an all-reduce: [B, H, D] and G [B, H]."""
    world, rank = comm.group.world, comm.group.rank
    tokens, heads = lse.shape
    part = heads // world
    if o.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        o = o.float()  # fp8 partials: collectives (gloo) may not move fp8
    if path == "ag_rs" or all_heads:
        lses = comm.all_gather(lse.float())
        fixed, total = correct(o, lses, rank, base2)
        if all_heads:
            return comm.all_reduce(fixed).to(out_dtype), total
        parts = fixed.reshape(tokens, world, part, -1).transpose(0, 1)
        out = comm.all_to_all(parts).sum(0)
        return out.to(out_dtype), total[:, rank * part:(rank + 1) * part]
    recv_o = comm.all_to_all(o.reshape(tokens, world, part, -1).transpose(0, 1))
    recv_lse = comm.all_to_all(lse.float().reshape(tokens, world, part).transpose(0, 1))
    exp, _ = _exp_log(base2)
    lses, total = merged(recv_lse, base2)
    w = exp(lses - total).unsqueeze(-1)
    w = torch.where(torch.isnan(w), 0.0, w)
    out = torch.where(w == 0, 0.0, w * recv_o.float()).sum(0)
    return out.to(out_dtype), total


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
    tokens, heads, dv = out.shape
    if lse.shape != (tokens, heads):
        raise DcpcArgumentError(f"{label}: LSE has shape {tuple(lse.shape)}, expected "
                                f"{(tokens, heads)} for an output of shape {tuple(out.shape)}")
    if heads % group.world:
        raise DcpcArgumentError(f"{label}: {heads} heads do not split over {group.world} "
                                "ranks (H % W != 0)")
    mode = switch(switch_name)
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
        r = runner(CombineRunner, spec, group, heads, backend, instance)
        reqs = None if seq_lens is None or not in_kernel else seq_lens.shape[0]
        if r.fits(tokens, reqs):
            if seq_lens is not None and not in_kernel:  # vLLM's mask, out of place
                return r.run(out, mask_at_source(lse.float(), seq_lens, qsl), None, None,
                             slot)
            lens = None if seq_lens is None else seq_lens.to(torch.int32).contiguous()
            q = None if qsl is None else qsl.to(torch.int32).contiguous()
            return r.run(out, lse if lse.dtype == torch.float32 else lse.float(), lens, q, slot)
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


def _unsupported(out: torch.Tensor, lse: torch.Tensor) -> str:
    """Why no dcpc module takes these inputs ("" when one does)."""
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the partial output dtype {out.dtype} is not bf16, f16 or f32"
    if not lse.dtype.is_floating_point or lse.dtype == torch.float8_e4m3fn:
        return f"the LSE dtype {lse.dtype} is not a float"
    if out.device.type not in ("cuda", "cpu"):
        return f"device {out.device} is neither CUDA nor CPU"
    return ""
