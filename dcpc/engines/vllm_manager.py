"""vLLM's MLADCPManager (vllm/v1/attention/ops/dcp.py of vLLM 0.33.0 and 0.34.0) on dcpc
modules: ``combine``, ``query_gather``, the KV gather of one MLA layer type and 0.34.0's
``v_up_proj_combine`` (the a2a merge with the W_UV up-projection) and
``direct_query_gather_max_tokens``. Open vLLM PR #52239's manager
(``init_kv_gather(max_gathered_tokens, token_dim, plane_split_dim, dtype)``,
``direct_kv_gather``) is dcpc.engines.vllm_kv.MLADCPManagerPR52239."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from dcpc.engines import capture, runners
from dcpc.engines.agree import agree, refusing
from dcpc.engines.combine import GatherRunner, check_tensors
from dcpc.engines.common import DTYPE_NAMES, GatherSpec, log, log_once, resolve_group, switch
from dcpc.engines.fallback import Comm
from dcpc.engines.vllm_free import (
    A2A_SWITCH,
    AG_RS_SWITCH,
    KV_GATHER_SWITCH,
    Q_GATHER_SWITCH,
    capture_sizes,
    cp_lse_ag_out_ar,
    engine_fallback,
    get_dcp_workspace_max_num_tokens,
    note_config,
    ubatch,
    v_up_proj_merge,
    vllm_combine,
)
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.local import sync_stream


def kv_runner(self: Any, dtype: torch.dtype, width: int) -> GatherRunner | None:
    """The rank-major KV gather module of ``dtype`` and ``width`` for a manager (``self``:
    MLADCPManager, or PR #52239's MLADCPKVGather, which shares it: dcpc.engines.vllm_kv),
    or None for the torch fallback."""
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
    return runners.runner(GatherRunner, spec, self.dcp, None, self.backend)


class MLADCPManager:
    """vLLM's MLADCPManager: ``combine``, ``query_gather`` and the KV gather of one MLA
    layer type, on modules built here, at model load (collective: every rank of the
    group constructs it), with the workspace fixed for ``max_num_tokens``.

    ``vllm_config`` may be None (tests): then pass ``group``, ``max_num_tokens``,
    ``num_ubatches`` and ``comm_backend`` ("ag_rs" or "a2a") as keywords.

    vLLM 0.34.0's attributes: ``v_up_proj_combine`` (set on the a2a path without PCP, as
    vLLM's NCCL path sets it: the MLA layer then gathers W_UV of every head at weight
    loading and merges up-projected outputs; None otherwise) and
    ``direct_query_gather_max_tokens`` (the workspace when dcpc's query gather runs on
    a symmetric-memory backend, so vLLM's prepare_mqa_query may gather the query early;
    0 when it runs over torch collectives, as vLLM's NCCL gather: such a gather could
    race other collectives on the communicator)."""

    # instance attributes holding a bound method (or None): the contract check
    # (dcpc.engines.contract.callable_of) compares the callers' arguments with these
    CALLABLE_ATTRIBUTES = {"query_gather": "_query_gather",
                           "v_up_proj_combine": "_v_up_proj_combine"}

    def __init__(self, vllm_config: Any, device: torch.device | str, num_heads: int,
                 query_head_dim: int, output_head_dim: int, query_dtype: torch.dtype,
                 output_dtype: torch.dtype, padded_num_heads: int | None = None,
                 is_lse_base_on_e: bool = True, use_pcp: bool = False, *, group: Any = None,
                 backend: str = "auto", max_num_tokens: int | None = None,
                 num_ubatches: int | None = None, comm_backend: str | None = None):
        device = torch.device(device)
        note_config(vllm_config)  # load_model: the free functions' config too
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
        self.v_up_proj_combine = (self._v_up_proj_combine if self.use_a2a and not use_pcp
                                  else None)
        self._capture: tuple[list[int] | None, str] = (None, "no capture sizes")
        self._warm_up(vllm_config)
        self.direct_query_gather_max_tokens = self._direct_query_tokens()

    # ---- construction ---------------------------------------------------------------------
    def _warm_up(self, vllm_config: Any) -> None:
        """Build the modules and compile every kernel now (collective), not in the first
        forward or a CUDA-graph capture: two calls per slot, since a call's ``release``
        runs at the start of the next one, at 1 token and at every CUDA-graph capture
        size (dcpc.engines.capture; ``DCPC_WARM_CAPTURE=0``: 1 token only)."""
        if self.dcp.world == 1:
            return
        sizes, source = capture.vllm_sizes(vllm_config)
        if os.environ.get(capture.SIZES_ENV) or not sizes:
            sizes, source = capture_sizes()
        self._capture = (sizes, source)
        warm, above = capture.plan(sizes or [], self.max_num_tokens)
        tokens = sorted({1, *warm}) if capture.enabled() else [1]
        start = time.perf_counter()
        for n in tokens:
            self._warm_calls(n)
        sync_stream(self.dcp.device)  # the warm-up's kernels done before the next host copy
        if capture.enabled() and sizes:
            rest = (f"; above the workspace {self.max_num_tokens} (fallback): {above}"
                    if above else "")
            log.info("MLADCPManager: warmed up for CUDA-graph capture sizes %s (%s; 2 calls "
                     "each per microbatch, %.2f s)%s",
                     [n for n in warm if n <= self.max_num_tokens], source,
                     time.perf_counter() - start, rest)

    def _warm_calls(self, tokens: int) -> None:
        dev = self.dcp.device
        if switch(self._combine_switch) != "off" and not self._all_reduce:
            out = torch.zeros(tokens, self.heads, self.output_head_dim,
                              dtype=self.output_dtype, device=dev)
            lse = torch.zeros(tokens, self.heads, dtype=torch.float32, device=dev)
            lens = torch.ones(tokens, dtype=torch.int32, device=dev)  # MLA always passes them
            qsl = torch.arange(tokens + 1, dtype=torch.int32, device=dev)
            for ub in [*range(self.num_ubatches)] * 2:
                self.combine(out, lse, seq_lens=lens, query_start_loc=qsl, slot=ub)
        if self.query_gather is not None and self._q_runner() is not None:
            for ub in [*range(self.num_ubatches)] * 2:
                q = torch.zeros(tokens, self.num_heads, self.query_head_dim, device=dev)
                self._query_gather(q.to(self.query_dtype), slot=ub)

    @property
    def _all_reduce(self) -> bool:
        """vLLM's choice: a2a if asked for (also with PCP), else PCP's all-reduce."""
        return self.use_pcp and not self.use_a2a

    @property
    def _combine_switch(self) -> str:
        return A2A_SWITCH if self.use_a2a else AG_RS_SWITCH

    # ---- combine ----------------------------------------------------------------------------
    def combine(self, partial_output: torch.Tensor, partial_lse: torch.Tensor, *,
                seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None,
                slot: int | None = None) -> torch.Tensor:
        """vLLM's DCPCombine: partials [B, H, Dv] of all heads -> [B, H/W, Dv] of this
        rank's heads (PCP with ag_rs: [B, H, Dv], all-reduced). ``slot``: the DBO
        microbatch (default: vLLM's current ubatch id)."""
        return self._merge(partial_output, partial_lse, seq_lens, query_start_loc, slot)

    def _merge(self, partial_output: torch.Tensor, partial_lse: torch.Tensor,
               seq_lens: torch.Tensor | None, query_start_loc: torch.Tensor | None,
               slot: int | None, out: torch.Tensor | None = None,
               label: str = "MLADCPManager.combine") -> torch.Tensor:
        if self._all_reduce:
            return cp_lse_ag_out_ar(partial_output, partial_lse, self.group,
                                    is_lse_base_on_e=self.is_lse_base_on_e,
                                    seq_lens=seq_lens, query_start_loc=query_start_loc)
        slot = ubatch() if slot is None else slot
        name = "dcp_a2a_lse_reduce" if self.use_a2a else "cp_lse_ag_out_rs"
        return vllm_combine("fused" if self.use_a2a else "ag_rs", partial_output,
                            partial_lse, self.group, False, self.is_lse_base_on_e, seq_lens,
                            query_start_loc, switch_name=self._combine_switch,
                            max_tokens=self.max_num_tokens, slots=self.num_ubatches,
                            slot=slot % self.num_ubatches, instance=0, backend=self.backend,
                            label=label, out=out, engine=engine_fallback(
                                name, partial_output, partial_lse, self.group,
                                is_lse_base_on_e=self.is_lse_base_on_e, seq_lens=seq_lens,
                                query_start_loc=query_start_loc))

    def _v_up_proj_combine(self, cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor,
                           w_uv: torch.Tensor, out: torch.Tensor,
                           seq_lens: torch.Tensor | None = None,
                           query_start_loc: torch.Tensor | None = None,
                           slot: int | None = None) -> None:
        """vLLM 0.34.0's v_up_proj_combine (``dcp_a2a_v_up_proj_lse_reduce`` on this
        manager's modules): MLA's partial latent outputs [B, H, L] of all heads merged
        over the group and up-projected by ``w_uv`` [H, L, V] (every head, rank order:
        the layer's W_UV_dcp) into ``out`` [B, H/W * V] (this rank's heads); see
        dcpc.engines.vllm_free.v_up_proj_merge. From the threshold up the module merges V
        values per head (its own schedule, warmed for the capture sizes at the first
        call); below, it is the L-wide combine of ``combine``."""
        label = "MLADCPManager.v_up_proj_combine"
        slot = ubatch() if slot is None else slot
        if self.dcp.world > 1:
            self._warm_v_up_proj(cp_attn_out, cp_attn_lse, w_uv, out, seq_lens,
                                 query_start_loc, slot)
        # the latent merged first is combine's module: combine's label, so a refused
        # call's empty call goes to the module its peers' call uses (dcpc.engines.agree)
        v_up_proj_merge(label, cp_attn_out, w_uv, out, self.dcp.rank, self.dcp.world,
                        lambda x, into: self._merge(
                            x, cp_attn_lse, seq_lens, query_start_loc, slot, into,
                            label if into is not None else "MLADCPManager.combine"))

    def _warm_v_up_proj(self, o: torch.Tensor, lse: torch.Tensor, w_uv: torch.Tensor,
                        out: torch.Tensor, seq_lens: torch.Tensor | None,
                        qsl: torch.Tensor | None, slot: int) -> None:
        """The first call of a W_UV shape warms every capture size (the V-wide module
        is built then: the manager does not know V at construction)."""
        rest = ("MLADCPManager.v_up_proj_combine", id(self), slot % self.num_ubatches,
                tuple(w_uv.shape), w_uv.dtype, seq_lens is None)
        capture.first_use(
            (*rest, o.shape[1:], o.stride(), o.dtype, out.stride()),
            lambda: (*rest, capture.layout(o), capture.layout(lse), capture.layout(out),
                     capture.mask_kind(seq_lens, qsl)),
            self.dcp.handle, rest[0], lambda: self._capture, self.max_num_tokens,
            lambda n: self._v_up_proj_combine(
                capture.like(o, n), capture.like(lse, n), w_uv, capture.like(out, n),
                *capture.mask_args(seq_lens, qsl, n), slot=slot),
            lambda: switch(self._combine_switch) != "off")

    # ---- query gather ---------------------------------------------------------------------
    def _q_runner(self) -> GatherRunner | None:
        if self.dcp.world == 1 or switch(Q_GATHER_SWITCH) == "off":
            return None
        if self.query_dtype not in DTYPE_NAMES:
            return self._unsupported_q(f"query dtype {self.query_dtype}")
        spec = GatherSpec("q", self.query_head_dim, DTYPE_NAMES[self.query_dtype],
                          self.max_num_tokens, self.num_ubatches)
        return runners.runner(GatherRunner, spec, self.dcp, self.heads, self.backend)

    def _direct_query_tokens(self) -> int:
        """vLLM's direct_query_gather_max_tokens: the workspace when the query gather runs
        on dcpc's symmetric-memory kernels (any backend but ``torch``), else 0."""
        r = self._q_runner() if self.query_gather is not None else None
        return self.max_num_tokens if r is not None and r.module.backend != "torch" else 0

    def _unsupported_q(self, what: str) -> None:
        if switch(Q_GATHER_SWITCH) == "on":
            raise DcpcArgumentError(f"{Q_GATHER_SWITCH}=1 but {what} is not supported")
        log_once(f"q:{what}", f"MLADCPManager.query_gather: torch fallback: {what}")

    def _query_gather(self, query: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        """vLLM's query gather: [B, H/W, Dq] of this rank's heads -> [B, H, Dq] of all
        (rank p's block at heads p*H/W ..), in padded storage when padded_num_heads is
        set (a copy then: vLLM's reserve_query_head_storage)."""
        slot = (ubatch() if slot is None else slot) % self.num_ubatches
        with refusing(self.dcp, query, "MLADCPManager.query_gather",  # every rank raises
                      lambda: self._settings(Q_GATHER_SWITCH, self.max_num_tokens), slot):
            check_tensors("MLADCPManager.query_gather", query=query)
        self._agree("query_gather", Q_GATHER_SWITCH, self.max_num_tokens)
        r = self._q_runner()
        if r is not None:
            runners.used(self.dcp, "MLADCPManager.query_gather", r, slot)
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
        agree(self.dcp, f"MLADCPManager.{what}", self._settings(switch_name, tokens),
              Comm(self.dcp).all_gather)

    def _settings(self, switch_name: str, tokens: int) -> dict[str, Any]:
        return {switch_name: switch(switch_name), "workspace tokens": tokens,
                "backend": self.backend}

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

    _kv_runner = kv_runner  # the rank-major gather module of a dtype and width

    def kv_gather(self, gathered_kv: torch.Tensor, local_kv: torch.Tensor,
                  slot: int | None = None) -> None:
        """vLLM's kv_gather (all_gather_into_tensor semantics): ``gathered_kv`` [W*N, C]
        receives every rank's ``local_kv`` [N, C] in rank order. dcpc gathers into its
        own symmetric buffer, then copies into ``gathered_kv``. ``slot``: the DBO
        microbatch (default: vLLM's current ubatch id)."""
        label = "MLADCPManager.kv_gather" if self._kv is not None else None
        with refusing(self.dcp, local_kv, label,  # every rank raises, or none
                      lambda: self._settings(KV_GATHER_SWITCH, self._kv[1]),  # type: ignore[index]
                      fail=True):
            check_tensors("MLADCPManager.kv_gather", gathered_kv=gathered_kv, local_kv=local_kv)
        if self._kv is not None:
            self._agree("kv_gather", KV_GATHER_SWITCH, self._kv[1])
        r = self._kv_runner(local_kv.dtype, local_kv.shape[1])
        slot = (ubatch() if slot is None else slot) % self.num_ubatches
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

