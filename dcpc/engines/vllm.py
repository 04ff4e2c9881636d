"""vLLM's DCP interface (vllm/v1/attention/ops/dcp.py, vLLM 0.33.0) on dcpc modules.

Same names, arguments and results as vLLM's, so a plugin can assign them over vLLM's
(docs/engines.md, "Engine adapters: vLLM and SGLang"):

- ``cp_lse_ag_out_rs``: all-gather LSE, correct, reduce-scatter (dcpc path ``ag_rs``;
  the correction and the sum run in fp32, rounded once: vLLM reduces in bf16);
- ``dcp_a2a_lse_reduce``: all-to-all + LSE-weighted merge (dcpc path ``fused``: one
  launch);
- ``cp_lse_ag_out_ar`` (PCP): torch only, as vLLM's math;
- ``correct_attn_out``: the local correction, in torch (fp32);
- ``get_dcp_workspace_max_num_tokens`` and ``MLADCPManager``.

``seq_lens`` are THIS rank's local KV lengths [B] (what vLLM passes); rows at or past
``query_start_loc[-1]`` and requests with local length 0 get LSE -inf as in vLLM's
mask_dcp_empty_shards_, but out of place (this adapter never writes its inputs; with
DCPC_KERNEL_MASK=1 the kernels mask instead). Results are views of the module's
persistent buffers: valid until the next call of the same shapes (consume or copy them
before that, as vLLM's layers do).

``install()`` puts them over vLLM's and keeps vLLM's own as the fallback of every call
dcpc does not take; without it the fallback is torch collectives in fp32.

Switches (tri-state env: unset = auto, 1 = force, 0 = the fallback):
``VLLM_USE_DIRECT_DCP_A2A`` (a2a), ``DCPC_VLLM_AG_RS`` (ag_rs), and, for the manager,
``VLLM_USE_DIRECT_DCP_Q_GATHER`` and ``VLLM_USE_DIRECT_DCP_KV_GATHER``. ``DCPC_BACKEND``
picks the module backend (default ``auto``), ``DCPC_MAX_NUM_TOKENS`` the workspace of
the free functions when no vLLM config is current. Warm up (two calls per shape) before
CUDA-graph capture: a call's ``release`` kernel first runs at the start of the next.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

import torch

from dcpc.engines.agree import agree
from dcpc.engines.combine import (
    EngineResult,
    GatherRunner,
    check_mask_args,
    check_tensors,
    combine_call,
    reset,
    runner,
)
from dcpc.engines.common import (
    DTYPE_NAMES,
    GatherSpec,
    log,
    log_once,
    rebind,
    resolve_group,
    switch,
)
from dcpc.engines.fallback import Comm, correct, mask_at_source, torch_combine
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.local import sync_stream

A2A_SWITCH = "VLLM_USE_DIRECT_DCP_A2A"
AG_RS_SWITCH = "DCPC_VLLM_AG_RS"
Q_GATHER_SWITCH = "VLLM_USE_DIRECT_DCP_Q_GATHER"
KV_GATHER_SWITCH = "VLLM_USE_DIRECT_DCP_KV_GATHER"
DEFAULT_MAX_NUM_TOKENS = 256  # the free functions' workspace without a vLLM config


# ---- helpers --------------------------------------------------------------------------
def _backend() -> str:
    return os.environ.get("DCPC_BACKEND", "auto")


def _ubatch() -> int:
    """vLLM's DBO microbatch of this thread (0 without vLLM or DBO)."""
    try:
        from vllm.v1.worker.ubatching import dbo_current_ubatch_id
    except ImportError:
        return 0
    return int(dbo_current_ubatch_id())


_installed_tokens: list[int] = []  # install(max_num_tokens=...): the free functions' workspace


def workspace_choice() -> tuple[int, str]:
    """(the free functions' workspace in tokens, where it came from): ``DCPC_MAX_NUM_TOKENS``,
    else ``install(max_num_tokens=)``, else vLLM's get_dcp_workspace_max_num_tokens of
    the config current now (vLLM sets one around model construction, where plugins and
    install() run in a worker), else 256."""
    env = os.environ.get("DCPC_MAX_NUM_TOKENS")
    if env:
        return int(env), "DCPC_MAX_NUM_TOKENS"
    if _installed_tokens:
        return _installed_tokens[0], "install(max_num_tokens=)"
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return DEFAULT_MAX_NUM_TOKENS, "the default: no vLLM config"
    config = get_current_vllm_config_or_none()
    if config is None:
        return DEFAULT_MAX_NUM_TOKENS, "the default: no vLLM config is current"
    return (get_dcp_workspace_max_num_tokens(config),
            "vLLM's config: max_num_batched_tokens, max_num_seqs, speculative tokens, "
            "CUDA-graph capture sizes")


@functools.cache
def _free_tokens() -> int:
    """The workspace of the free functions, decided once per process (every call must
    find the same module): see workspace_choice. In a vLLM server no config is current
    in forward, so the first call's choice may be the default: install() from a plugin
    (a config is current when vLLM loads plugins in a worker), or set one of the
    first two, and read install()'s log line."""
    return workspace_choice()[0]


# ---- installing over vLLM's own -------------------------------------------------------------
PATCHED = ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce", "MLADCPManager")
KEPT = ("cp_lse_ag_out_ar",)  # not replaced (no dcpc schedule): vLLM's own is called
_originals: dict[str, Any] = {}  # vLLM's own, saved by install(): the fallbacks


def install(max_num_tokens: int | None = None) -> list[str]:
    """Put this module's functions over vLLM's (vllm.v1.attention.ops.dcp) in every module
    that holds them (``from ... import`` bindings included), keeping vLLM's own as the
    fallback of calls dcpc does not take (more tokens than the workspace, an unsupported
    dtype, a switch at 0) and for PCP's all-reduce. ``max_num_tokens``: the free
    functions' workspace (else DCPC_MAX_NUM_TOKENS, else 256: see _free_tokens).
    Idempotent; returns the bindings patched. Call it from a vLLM general plugin
    (docs/engines.md, "Switching vLLM"). On a vLLM whose DCP layout is not 0.33.0's
    (git main moved it to vllm.v1.attention.ops.dcp_utils and changed init_kv_gather)
    it patches nothing, logs why once, and returns []: vLLM's own path stays."""
    ops, why = _known_layout()
    if ops is None:
        log_once("vllm-layout", f"dcpc.engines.vllm.install(): vLLM's own DCP path stays: "
                 f"{why} (the adapters follow vLLM 0.33.0's layout)")
        return []
    if max_num_tokens is not None:
        _installed_tokens[:] = [int(max_num_tokens)]
        _free_tokens.cache_clear()
    tokens, source = workspace_choice()
    if source.startswith("vLLM"):  # kept: in forward no config is current any more
        _installed_tokens[:] = [tokens]
        _free_tokens.cache_clear()
    log.info("dcpc.engines.vllm.install(): the free functions' workspace is %d tokens "
             "(%s)", tokens, source)
    ours = {name: globals()[name] for name in PATCHED + KEPT}
    patched: list[str] = []
    for name in PATCHED + KEPT:
        old = vars(ops)[name]
        if old is not ours[name] and not _is_ours(old):  # never keep a dcpc function as
            _originals.setdefault(name, old)  # vLLM's own: its fallback would recurse
        if name in PATCHED and old is not ours[name]:
            patched += rebind(name, old, ours[name])
    return patched


def _known_layout() -> tuple[Any, str]:
    """(vLLM's vllm.v1.attention.ops.dcp, "") when it is 0.33.0's layout: the four names,
    and MLADCPManager.init_kv_gather(workspace, max_gathered_tokens); else (None, why)."""
    try:
        import vllm.v1.attention.ops.dcp as ops
    except ImportError as err:
        return None, f"vllm.v1.attention.ops.dcp does not import ({err})"
    missing = [name for name in PATCHED + KEPT if name not in vars(ops)]
    if missing:
        return None, f"vllm.v1.attention.ops.dcp has no {', '.join(missing)}"
    kv = getattr(vars(ops)["MLADCPManager"], "init_kv_gather", None)
    if kv is not None:
        params = list(inspect.signature(kv).parameters)[1:]
        if params != ["workspace", "max_gathered_tokens"]:
            return None, (f"MLADCPManager.init_kv_gather({', '.join(params)}) is not "
                          "0.33.0's (workspace, max_gathered_tokens)")
    return ops, ""


def _is_ours(fn: Any) -> bool:
    return getattr(fn, "__module__", "").startswith("dcpc.")


def _engine_fallback(name: str, *args: Any, **kwargs: Any) -> Any:
    """vLLM's own ``name`` called with these arguments, if install() saved it."""
    original = _originals.get(name)
    if original is None or _is_ours(original):
        return None
    return lambda: original(*args, **kwargs)


def _squeeze(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM squeezes a [B, 1, H, D] output (and a 1-sized dim of the LSE)."""
    if out.dim() == 4:
        out = out.squeeze(1)
    if lse.dim() == 3:
        lse = lse.squeeze(1) if lse.shape[1] == 1 else lse.squeeze(-1)
    if out.dim() != 3 or lse.dim() != 2:
        raise DcpcArgumentError(f"expected an output [B, H, D] and an LSE [B, H], got "
                                f"{tuple(out.shape)} and {tuple(lse.shape)}")
    return out, lse


def _combine(path: str, cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
             return_lse: bool, is_lse_base_on_e: bool, seq_lens: Any, query_start_loc: Any,
             *, switch_name: str, max_tokens: int | None = None, slots: int = 1,
             slot: int = 0, instance: int | None = None, backend: str | None = None,
             label: str, engine: Any = None) -> Any:
    """The free functions and the manager's combine: vLLM's argument handling (a 4-D
    output squeezed, W == 1 returns the inputs), then ``combine_call`` (``engine``:
    vLLM's own function as the fallback); the result as vLLM returns it (``out``, or
    ``(out, lse)`` with ``return_lse``)."""
    check_mask_args(seq_lens, query_start_loc)
    check_tensors(label, out=cp_attn_out, lse=cp_attn_lse)
    out, lse = _squeeze(cp_attn_out, cp_attn_lse)
    group = resolve_group(cp_group, out.device)
    if group.world == 1:
        return (out, lse) if return_lse else out
    got = combine_call(
        path, out, lse, group, base2=not is_lse_base_on_e, seq_lens=seq_lens,
        qsl=query_start_loc, switch_name=switch_name,
        max_tokens=max_tokens or _free_tokens(), slots=slots, slot=slot,
        instance=_ubatch() if instance is None else instance,
        backend=backend or _backend(), label=label, engine=engine)
    if isinstance(got, EngineResult):
        return got.value
    got, got_lse = got
    if not return_lse:
        return got
    # ag_rs: the LSE in cp_attn_lse's dtype (vLLM's lse); a2a: fp32
    return got, (got_lse.to(cp_attn_lse.dtype) if path == "ag_rs" else got_lse)


# ---- the free functions -----------------------------------------------------------------
def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                     ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                     seq_lens: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None) -> Any:
    """vLLM's cp_lse_ag_out_rs: [B, H, D] partials of all heads -> this rank's heads
    [B, H/W, D] (rank r: heads r*H/W ..), with ``return_lse`` also the global LSE of
    those heads [B, H/W] in cp_attn_lse's dtype. ``ctx`` (the Triton context) is unused."""
    return _combine("ag_rs", cp_attn_out, cp_attn_lse, cp_group, return_lse,
                    is_lse_base_on_e, seq_lens, query_start_loc, switch_name=AG_RS_SWITCH,
                    label="cp_lse_ag_out_rs", engine=_engine_fallback(
                        "cp_lse_ag_out_rs", cp_attn_out, cp_attn_lse, cp_group, ctx,
                        return_lse, is_lse_base_on_e, seq_lens, query_start_loc))


def dcp_a2a_lse_reduce(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                       ctx: Any = None, return_lse: bool = False,
                       is_lse_base_on_e: bool = True, seq_lens: torch.Tensor | None = None,
                       query_start_loc: torch.Tensor | None = None) -> Any:
    """vLLM's dcp_a2a_lse_reduce: as cp_lse_ag_out_rs, through one fused all-to-all +
    merge; the returned LSE is fp32. H % W != 0 raises (a ValueError, as vLLM)."""
    return _combine("fused", cp_attn_out, cp_attn_lse, cp_group, return_lse,
                    is_lse_base_on_e, seq_lens, query_start_loc, switch_name=A2A_SWITCH,
                    label="dcp_a2a_lse_reduce", engine=_engine_fallback(
                        "dcp_a2a_lse_reduce", cp_attn_out, cp_attn_lse, cp_group, ctx,
                        return_lse, is_lse_base_on_e, seq_lens, query_start_loc))


def cp_lse_ag_out_ar(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                     ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                     seq_lens: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None) -> Any:
    """vLLM's cp_lse_ag_out_ar (PCP + DCP): the corrected output of ALL heads [B, H, D]
    (all-reduce) and the full LSE [B, H]. No dcpc schedule: vLLM's own after install(),
    else torch collectives (fp32)."""
    theirs = _engine_fallback("cp_lse_ag_out_ar", cp_attn_out, cp_attn_lse, cp_group, ctx,
                              return_lse, is_lse_base_on_e, seq_lens, query_start_loc)
    if theirs is not None:  # installed: vLLM's own (one all-reduce, its kernels)
        return theirs()
    mask = check_mask_args(seq_lens, query_start_loc)
    check_tensors("cp_lse_ag_out_ar", out=cp_attn_out, lse=cp_attn_lse)
    out, lse = _squeeze(cp_attn_out, cp_attn_lse)
    group = resolve_group(cp_group, out.device)
    if group.world == 1:
        return (out, lse) if return_lse else out
    lse32 = mask_at_source(lse.float(), seq_lens, query_start_loc) if mask else lse.float()
    got, total = torch_combine(Comm(group), "ag_rs", out, lse32, not is_lse_base_on_e,
                               out.dtype, all_heads=True)
    return (got, total.to(lse.dtype)) if return_lse else got


def correct_attn_out(out: torch.Tensor, lses: torch.Tensor, cp_rank: int, ctx: Any = None,
                     is_lse_base_on_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's correct_attn_out: ``out`` [B, H, D] *= exp(lses[cp_rank] - G) IN PLACE (as
    vLLM: 0 where the factor is 0), G merged over lses [N, B, H]; returns (out, G [B, H]
    in lses' dtype). Local math (no communication), in torch fp32."""
    check_tensors("correct_attn_out", out=out, lse=lses)
    if out.dim() == 4:
        out = out.squeeze(1)
    if lses.dim() == 4 and lses.shape[-1] == 1:  # vLLM: [N, B, H, 1], then [N, 1, B, H]
        lses = lses.squeeze(-1)
    if lses.dim() == 4 and lses.shape[1] == 1:
        lses = lses.squeeze(1)
    if lses.dim() != 3 or lses.shape[1:] != out.shape[:2]:
        raise DcpcArgumentError(f"correct_attn_out: lses {tuple(lses.shape)} is not [N, B, H] "
                                f"for out {tuple(out.shape)}")
    if not 0 <= cp_rank < lses.shape[0]:
        raise DcpcArgumentError(f"correct_attn_out: cp_rank {cp_rank} outside "
                                f"0..{lses.shape[0] - 1}")
    fixed, total = correct(out, lses, cp_rank, not is_lse_base_on_e)
    out.copy_(fixed)
    return out, total.to(lses.dtype)


def get_dcp_workspace_max_num_tokens(vllm_config: Any) -> int:
    """vLLM's own function when vLLM is installed; else vLLM's formula (git main,
    2026-12): min(max_num_batched_tokens, max(max_num_seqs * tokens_per_seq, the
    largest CUDA-graph capture size)), tokens_per_seq = 1 + k speculative tokens, or
    1 + 2k with parallel drafting (vLLM's own test: 4 sequences, k = 3 -> 28)."""
    try:
        from vllm.v1.attention.ops.dcp import get_dcp_workspace_max_num_tokens as theirs
    except ImportError:
        theirs = None
    if theirs is not None:
        return int(theirs(vllm_config))
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(vllm_config, "num_speculative_tokens", None)
    if k is None:  # vLLM's VllmConfig has the property; older configs only the spec's
        k = getattr(spec, "num_speculative_tokens", 0) or 0
    per_seq = 1 + (2 if getattr(spec, "parallel_drafting", False) else 1) * k
    sched = vllm_config.scheduler_config
    graphs = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None) or 0
    return min(sched.max_num_batched_tokens, max(sched.max_num_seqs * per_seq, graphs))


# ---- MLADCPManager ------------------------------------------------------------------------
class MLADCPManager:
    """vLLM's MLADCPManager: ``combine``, ``query_gather`` and the KV gather of one MLA
    layer type, on modules built here, at model load (collective: every rank of the
    group constructs it), with the workspace fixed for ``max_num_tokens``.

    ``vllm_config`` may be None (tests): then pass ``group``, ``max_num_tokens``,
    ``num_ubatches`` and ``comm_backend`` ("ag_rs" or "a2a") as keywords."""

    def __init__(self, vllm_config: Any, device: torch.device | str, num_heads: int,
                 query_head_dim: int, output_head_dim: int, query_dtype: torch.dtype,
                 output_dtype: torch.dtype, padded_num_heads: int | None = None,
                 is_lse_base_on_e: bool = True, use_pcp: bool = False, *, group: Any = None,
                 backend: str = "auto", max_num_tokens: int | None = None,
                 num_ubatches: int | None = None, comm_backend: str | None = None):
        device = torch.device(device)
        if group is None:
            from vllm.distributed import get_dcp_group

            group = get_dcp_group()
        self.group, self.device = group, device  # vLLM's attributes (models read group)
        self.dcp = resolve_group(group, device)
        parallel = getattr(vllm_config, "parallel_config", None)
        self.num_ubatches = max(num_ubatches or getattr(parallel, "num_ubatches", 1) or 1, 1)
        if vllm_config is None and max_num_tokens is None:
            raise DcpcArgumentError("MLADCPManager: without a vllm_config, pass "
                                    "max_num_tokens= (the workspace's token count)")
        self.max_num_tokens = max_num_tokens or get_dcp_workspace_max_num_tokens(vllm_config)
        comm_backend = comm_backend or getattr(parallel, "dcp_comm_backend", None) or "ag_rs"
        if comm_backend not in ("ag_rs", "a2a"):
            raise DcpcArgumentError(f"MLADCPManager: dcp_comm_backend must be 'ag_rs' or "
                                    f"'a2a', got {comm_backend!r}")
        self.use_a2a, self.use_pcp = comm_backend == "a2a", use_pcp
        self.num_heads, self.padded_num_heads = num_heads, padded_num_heads
        self.heads = num_heads * self.dcp.world
        self.query_head_dim, self.output_head_dim = query_head_dim, output_head_dim
        self.query_dtype, self.output_dtype = query_dtype, output_dtype
        self.is_lse_base_on_e, self.backend = is_lse_base_on_e, backend
        self._kv: tuple[torch.Tensor, int] | None = None
        self.query_gather = None if use_pcp else self._query_gather
        self._warm_up()

    # ---- construction ---------------------------------------------------------------------
    def _warm_up(self) -> None:
        """Build the modules and compile every kernel now (collective), not in the first
        forward or a CUDA-graph capture: two calls per slot, since a call's ``release``
        runs at the start of the next one."""
        if self.dcp.world == 1:
            return
        dev = self.dcp.device
        if switch(self._combine_switch) != "off" and not self._all_reduce:
            out = torch.zeros(1, self.heads, self.output_head_dim, dtype=self.output_dtype,
                              device=dev)
            lse = torch.zeros(1, self.heads, dtype=torch.float32, device=dev)
            lens = torch.ones(1, dtype=torch.int32, device=dev)  # MLA always passes them
            qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
            for ub in [*range(self.num_ubatches)] * 2:
                self.combine(out, lse, seq_lens=lens, query_start_loc=qsl, slot=ub)
        if self.query_gather is not None and self._q_runner() is not None:
            for ub in [*range(self.num_ubatches)] * 2:
                q = torch.zeros(1, self.num_heads, self.query_head_dim, device=dev)
                self._query_gather(q.to(self.query_dtype), slot=ub)
        sync_stream(dev)  # the warm-up's kernels done before the caller's next host copy

    @property
    def _all_reduce(self) -> bool:
        """vLLM's choice: a2a if asked for (also with PCP), else PCP's all-reduce."""
        return self.use_pcp and not self.use_a2a

    @property
    def _combine_switch(self) -> str:
        return A2A_SWITCH if self.use_a2a else AG_RS_SWITCH

    # ---- combine --------------------------------------------------------------------------
    def combine(self, partial_output: torch.Tensor, partial_lse: torch.Tensor, *,
                seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None,
                slot: int | None = None) -> torch.Tensor:
        """vLLM's DCPCombine: partials [B, H, Dv] of all heads -> [B, H/W, Dv] of this
        rank's heads (PCP with ag_rs: [B, H, Dv], all-reduced). ``slot``: the DBO
        microbatch (default: vLLM's current ubatch id)."""
        if self._all_reduce:
            return cp_lse_ag_out_ar(partial_output, partial_lse, self.group,
                                    is_lse_base_on_e=self.is_lse_base_on_e,
                                    seq_lens=seq_lens, query_start_loc=query_start_loc)
        slot = _ubatch() if slot is None else slot
        name = "dcp_a2a_lse_reduce" if self.use_a2a else "cp_lse_ag_out_rs"
        return _combine("fused" if self.use_a2a else "ag_rs", partial_output, partial_lse,
                        self.group, False, self.is_lse_base_on_e, seq_lens,
                        query_start_loc, switch_name=self._combine_switch,
                        max_tokens=self.max_num_tokens, slots=self.num_ubatches,
                        slot=slot % self.num_ubatches, instance=0, backend=self.backend,
                        label="MLADCPManager.combine", engine=_engine_fallback(
                            name, partial_output, partial_lse, self.group,
                            is_lse_base_on_e=self.is_lse_base_on_e, seq_lens=seq_lens,
                            query_start_loc=query_start_loc))

    # ---- query gather ---------------------------------------------------------------------
    def _q_runner(self) -> GatherRunner | None:
        if self.dcp.world == 1 or switch(Q_GATHER_SWITCH) == "off":
            return None
        if self.query_dtype not in DTYPE_NAMES:
            return self._unsupported_q(f"query dtype {self.query_dtype}")
        spec = GatherSpec("q", self.query_head_dim, DTYPE_NAMES[self.query_dtype],
                          self.max_num_tokens, self.num_ubatches)
        return runner(GatherRunner, spec, self.dcp, self.heads, self.backend)

    def _unsupported_q(self, what: str) -> None:
        if switch(Q_GATHER_SWITCH) == "on":
            raise DcpcArgumentError(f"{Q_GATHER_SWITCH}=1 but {what} is not supported")
        log_once(f"q:{what}", f"MLADCPManager.query_gather: torch fallback: {what}")

    def _query_gather(self, query: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        """vLLM's query gather: [B, H/W, Dq] of this rank's heads -> [B, H, Dq] of all
        (rank p's block at heads p*H/W ..), in padded storage when padded_num_heads is
        set (a copy then: vLLM's reserve_query_head_storage)."""
        slot = (_ubatch() if slot is None else slot) % self.num_ubatches
        check_tensors("MLADCPManager.query_gather", query=query)
        self._agree("query_gather", Q_GATHER_SWITCH, self.max_num_tokens)
        r = self._q_runner()
        if r is not None and r.fits(query.shape[0]):
            full = r.run(query, slot)
        else:
            if r is not None:
                r.skip(query, slot)  # every rank falls back, or every rank fails
                log_once("q:tokens", f"MLADCPManager.query_gather: torch fallback: "
                         f"{query.shape[0]} tokens exceed the workspace {self.max_num_tokens}")
            full = _gather_heads(Comm(self.dcp), query)
        return self._pad(full)

    def _pad(self, full: torch.Tensor) -> torch.Tensor:
        padded = self.padded_num_heads
        if padded is None or padded == full.shape[1]:
            return full
        # vLLM's reserve_query_head_storage: a contiguous [B, H, D] over storage sized
        # for [B, padded, D] (kernels that read padded heads may read past H)
        store = full.new_empty((full.shape[0], padded, full.shape[2]))
        store.resize_(full.shape)
        return store.copy_(full)

    def _agree(self, what: str, switch_name: str, tokens: int) -> None:
        """The settings that pick this gather's path agree on every rank (agree.py)."""
        agree(self.dcp, f"MLADCPManager.{what}", {switch_name: switch(switch_name),
              "workspace tokens": tokens, "backend": self.backend}, Comm(self.dcp).all_gather)

    # ---- KV gather ------------------------------------------------------------------------
    def init_kv_gather(self, workspace: torch.Tensor, max_gathered_tokens: int) -> None:
        """vLLM's init_kv_gather: ``workspace`` [(T + T/W), C] contiguous; T % W == 0."""
        w, t = self.dcp.world, max_gathered_tokens
        if t <= 0 or t % w:
            raise DcpcArgumentError(f"init_kv_gather: max_gathered_tokens {t} must be a "
                                    f"positive multiple of W={w}")
        if not workspace.is_contiguous() or workspace.dim() != 2 or \
                workspace.shape[0] != t + t // w:
            raise DcpcArgumentError(f"init_kv_gather: the workspace must be a contiguous "
                                    f"[T + T/W, C] = [{t + t // w}, C] tensor, got "
                                    f"{tuple(workspace.shape)}")
        self._kv = (workspace, t)
        r = self._kv_runner(workspace.dtype, workspace.shape[1])
        if r is not None:  # build and compile now (collective); release() runs next call
            for ub in [*range(self.num_ubatches)] * 2:
                r.run(workspace[: t // w], slot=ub)

    def _kv_runner(self, dtype: torch.dtype, width: int) -> GatherRunner | None:
        if self._kv is None:
            raise DcpcArgumentError("kv_gather: call init_kv_gather(workspace, T) first")
        if self.dcp.world == 1 or switch(KV_GATHER_SWITCH) == "off":
            return None
        if dtype not in DTYPE_NAMES:
            if switch(KV_GATHER_SWITCH) == "on":
                raise DcpcArgumentError(f"{KV_GATHER_SWITCH}=1 but KV dtype {dtype} is "
                                        "not supported")
            log_once(f"kv:{dtype}", f"MLADCPManager.kv_gather: torch fallback: {dtype}")
            return None
        spec = GatherSpec("kv", width, DTYPE_NAMES[dtype], self._kv[1] // self.dcp.world,
                          self.num_ubatches)
        return runner(GatherRunner, spec, self.dcp, None, self.backend)

    def kv_gather(self, gathered_kv: torch.Tensor, local_kv: torch.Tensor,
                  slot: int | None = None) -> None:
        """vLLM's kv_gather (all_gather_into_tensor semantics): ``gathered_kv`` [W*N, C]
        receives every rank's ``local_kv`` [N, C] in rank order. dcpc gathers into its
        own symmetric buffer, then copies into ``gathered_kv``. ``slot``: the DBO
        microbatch (default: vLLM's current ubatch id)."""
        check_tensors("MLADCPManager.kv_gather", gathered_kv=gathered_kv, local_kv=local_kv)
        if self._kv is not None:
            self._agree("kv_gather", KV_GATHER_SWITCH, self._kv[1])
        r = self._kv_runner(local_kv.dtype, local_kv.shape[1])
        slot = (_ubatch() if slot is None else slot) % self.num_ubatches
        if r is not None and r.fits(local_kv.shape[0]):  # one slot per DBO microbatch
            gathered_kv.copy_(r.run(local_kv, slot=slot))
            return
        # no empty marker call here (the rank-major gather module divides by T: T = 0
        # raises ZeroDivisionError); vLLM sizes every rank's chunk alike (init_kv_gather)
        gathered_kv.copy_(Comm(self.dcp).all_gather(local_kv).reshape(gathered_kv.shape))


def _gather_heads(comm: Comm, query: torch.Tensor) -> torch.Tensor:
    """[B, H/W, D] per rank -> [B, H, D], rank order (group.all_gather(query, dim=1))."""
    parts = comm.all_gather(query)  # [W, B, H/W, D]
    return parts.permute(1, 0, 2, 3).reshape(query.shape[0], -1, query.shape[2])


__all__ = [
    "MLADCPManager",
    "install",
    "correct_attn_out",
    "cp_lse_ag_out_ar",
    "cp_lse_ag_out_rs",
    "dcp_a2a_lse_reduce",
    "get_dcp_workspace_max_num_tokens",
    "reset",
]
