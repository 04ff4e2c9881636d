"""The MLA DCP KV gather of open vLLM PR #52239 (vllm/v1/attention/ops/dcp_utils.py,
unreleased: vLLM 0.33.0 and 0.34.0 have neither the module nor this interface) on dcpc
modules.

The PR splits the KV gather out of ``MLADCPManager`` into ``MLADCPKVGather``
(``MLADCPManager`` then derives from it) and changes its interface:

- ``init_kv_gather(max_gathered_tokens, token_dim, plane_split_dim, dtype) -> bool``:
  True when the "direct" final-layout gather is selected (then the caller keeps only
  T/W local rows and calls ``direct_kv_gather``), False for the rank-major
  ``kv_gather(gathered_kv, local_kv)`` (all_gather_into_tensor semantics; the caller
  keeps a [T + T/W, C] workspace and reorders the rows itself);
- ``direct_kv_gather(local_kv, dst_rows, output_tokens, buffer_slot) -> (kv_c, k_pe)``:
  local row i lands at row ``dst_rows[i]`` (-1: a padding row, dropped) of a compact
  [output_tokens, token_dim] window, returned as two planes [output_tokens, 1,
  plane_split_dim] and [output_tokens, 1, token_dim - plane_split_dim], views of a
  buffer owned per (DBO microbatch, ``buffer_slot``), valid until that slot's next
  gather (vLLM: ``DirectDCPKVGatherWorkspace._slot_planes``).

Which path ``init_kv_gather`` selects follows ``VLLM_USE_DIRECT_DCP_KV_GATHER``: unset
(auto) -> False, the rank-major gather on dcpc's kernel (vLLM's own well-trodden
fallback layout); 1 -> True, ``direct_kv_gather`` on the same kernel (the rows and
their destinations move in one gather, the destinations bit-cast into extra columns,
then each rank places the rows locally); 0 -> False on torch collectives. Not
provided: the copy-engine publisher's packed-record transport (``uses_packed_records``
is False, ``packed_dma_planes`` / ``unpack_context_planes`` raise as vLLM's do when it
is not reserved) and the two-switch relay (``kv_gather_relay`` is None: a route, not
a result; ``direct_kv_gather_dma`` gives the same planes through the plain gather).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dcpc.engines.agree import refusing
from dcpc.engines.common import DTYPE_NAMES, log_once, resolve_group, switch
from dcpc.engines.fallback import Comm
from dcpc.engines.vllm_free import KV_GATHER_SWITCH, ubatch
from dcpc.engines.vllm_manager import MLADCPManager, kv_runner

SLOTS_ENV = "VLLM_DCP_KV_GATHER_SLOTS"  # PR #52239: slots per ubatch of the direct gather


def _slots() -> int:
    """PR #52239's kv_gather_slots(): VLLM_DCP_KV_GATHER_SLOTS (default 2, at least 2)."""
    slots = int(os.environ.get(SLOTS_ENV) or 2)
    if slots < 2:
        raise ValueError(f"{SLOTS_ENV} must be at least 2, got {slots}")
    return slots


def _index_columns(dst_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dst_rows`` [N] as int32 bit-cast into columns of ``dtype`` [N, 4/itemsize]
    (checked first: ``_check_destinations``, so the cast never wraps nor truncates)."""
    rows = dst_rows.to(torch.int32).contiguous().view(-1, 1)
    return rows.view(dtype).reshape(rows.shape[0], -1)


def _duplicate(dst: torch.Tensor) -> int | None:
    """A destination row that ``dst`` names twice (-1, a dropped row, may repeat)."""
    live = dst[dst >= 0]
    values, counts = torch.unique(live, return_counts=True)
    twice = values[counts > 1]
    return int(twice[0]) if len(twice) else None


def _check_destinations(dst_rows: torch.Tensor, output_tokens: int) -> None:
    """vLLM's direct gather contract, before anything moves: ``dst_rows`` holds integers,
    each -1 (a padding row, dropped) or a row in 0..output_tokens-1, no row twice; else
    ValueError naming the first offender (an int64 2**32 or a float 0.9 would otherwise
    land on row 0 through the int32 cast, and -2 would be dropped like -1)."""
    if dst_rows.dtype.is_floating_point or dst_rows.dtype.is_complex \
            or dst_rows.dtype == torch.bool:
        raise ValueError(f"DCP kv-gather: dst_rows must hold integer row numbers, got "
                         f"{dst_rows.dtype}")
    dst = dst_rows.to(torch.int64).reshape(-1).cpu()
    bad = torch.nonzero((dst < -1) | (dst >= output_tokens)).flatten()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"DCP kv-gather: dst_rows[{i}] = {int(dst[i])} is outside "
                         f"0..{output_tokens - 1} (output_tokens {output_tokens}); -1 drops a "
                         "row")
    row = _duplicate(dst)
    if row is not None:
        raise ValueError(f"DCP kv-gather: dst_rows names destination row {row} twice; each "
                         "row of the output is written by one local row of one rank")


class MLADCPKVGather:
    """PR #52239's MLADCPKVGather(group, device, num_ubatches): the chunked-context KV
    gather of an MLA layer, on dcpc modules (see the module's docstring)."""

    _kv_runner = kv_runner  # the rank-major gather module of a dtype, width (MLADCPManager's)

    def __init__(self, group: Any, device: torch.device | str, num_ubatches: int, *,
                 backend: str = "auto"):
        self.group, self.device = group, torch.device(device)
        self.dcp = resolve_group(group, self.device)
        self.num_ubatches = max(int(num_ubatches), 1)
        self.backend = backend
        self._kv: tuple[Any, int] | None = None
        self._kv_layout_init(None)

    def _kv_layout_init(self, layout: tuple[int, int, torch.dtype] | None) -> None:
        self._layout = layout  # (token_dim, plane_split_dim, dtype) of the direct path
        self._planes: torch.Tensor | None = None

    # ---- selection --------------------------------------------------------------------------
    def init_kv_gather(self, max_gathered_tokens: int, token_dim: int, plane_split_dim: int,
                       dtype: torch.dtype) -> bool:
        """PR #52239's init_kv_gather: the capacity (a positive multiple of W) and the row
        layout; returns whether the direct final-layout gather is selected."""
        w, t = self.dcp.world, max_gathered_tokens
        if t <= 0 or t % w:
            raise ValueError("DCP KV gather capacity must be positive and divide evenly "
                             f"across {w} ranks, got {t}")
        if token_dim <= 0:
            raise ValueError(f"DCP KV gather token dimension must be positive: {token_dim}")
        self._kv = (None, t)
        direct = switch(KV_GATHER_SWITCH) == "on" and w > 1
        if direct and not 0 < plane_split_dim < token_dim:
            log_once(f"kv:split:{plane_split_dim}/{token_dim}", "MLADCPKVGather: the "
                     f"direct KV gather needs two nonempty planes (plane_split_dim "
                     f"{plane_split_dim} of {token_dim}): the rank-major gather instead")
            direct = False
        if direct and dtype not in DTYPE_NAMES:
            log_once(f"kv:direct:{dtype}", f"MLADCPKVGather: direct KV gather: {dtype} "
                     "is not supported: the rank-major gather instead")
            direct = False
        self._kv_layout_init((token_dim, plane_split_dim, dtype) if direct else None)
        width = token_dim + (_index_columns(torch.zeros(1), dtype).shape[1] if direct else 0)
        r = self._kv_runner(dtype, width)
        if r is not None:  # build and compile now (collective); release() runs next call
            rows = torch.zeros(t // w, width, dtype=dtype, device=self.dcp.device)
            for ub in [*range(self.num_ubatches)] * 2:
                r.run(rows, slot=ub)
        if direct:  # one compact window per (microbatch, slot): vLLM's received_kv
            self._planes = torch.empty(self.num_ubatches, _slots(), t * token_dim,
                                       dtype=dtype, device=self.dcp.device)
        return direct

    @property
    def use_direct_kv_gather(self) -> bool:
        return self._layout is not None

    @property
    def uses_packed_records(self) -> bool:
        return False

    @property
    def kv_gather_slots(self) -> int:
        """Slots per microbatch of the direct gather (0 without it), as vLLM's."""
        return 0 if self._planes is None else self._planes.shape[1]

    @property
    def kv_gather_relay(self) -> None:
        return None

    def packed_dma_planes(self, tokens: int) -> Any:
        raise RuntimeError("packed KV staging was not reserved")

    def unpack_context_planes(self, packed_c: torch.Tensor, packed_rope: torch.Tensor) -> Any:
        raise RuntimeError("packed KV receive workspace was not reserved")

    # ---- the rank-major gather ----------------------------------------------------------------
    def kv_gather(self, gathered_kv: torch.Tensor, local_kv: torch.Tensor) -> None:
        """PR #52239's kv_gather: all_gather_into_tensor semantics (``gathered_kv``
        [W*N, C] receives every rank's ``local_kv`` [N, C] in rank order)."""
        if self._kv is not None and self._layout is not None:
            raise RuntimeError("NCCL DCP KV gather is not selected")
        MLADCPManager.kv_gather(self, gathered_kv, local_kv)  # type: ignore[arg-type]

    # ---- the direct (final-layout) gather ---------------------------------------------------
    def direct_kv_gather(self, local_kv: torch.Tensor, dst_rows: torch.Tensor,
                         output_tokens: int, buffer_slot: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """PR #52239's direct_kv_gather (see the module's docstring)."""
        if self._layout is None or self._planes is None or self._kv is None:
            raise RuntimeError("direct DCP KV gather is not enabled")
        token_dim, split, dtype = self._layout
        # a rank whose arguments are refused fails its modules: its peers' waits stop
        with refusing(self.dcp, local_kv, None, dict, fail=True):
            ub = ubatch()
            if not 0 <= ub < self.num_ubatches:
                raise ValueError(f"DCP kv-gather ubatch {ub} exceeds {self.num_ubatches} slots")
            if not 0 <= buffer_slot < self._planes.shape[1]:
                raise ValueError(f"DCP kv-gather buffer slot {buffer_slot} outside "
                                 f"0..{self._planes.shape[1] - 1}")
            capacity = self._kv[1]
            if not 0 <= output_tokens <= capacity:
                raise ValueError(f"DCP kv-gather output_tokens {output_tokens} exceeds the "
                                 f"capacity {capacity}")
            if local_kv.dim() != 2 or local_kv.shape[1] != token_dim or local_kv.dtype != dtype \
                    or dst_rows.shape != local_kv.shape[:1]:
                raise ValueError(f"DCP kv-gather: local_kv {tuple(local_kv.shape)} "
                                 f"{local_kv.dtype} and dst_rows {tuple(dst_rows.shape)} must be "
                                 f"[N, {token_dim}] {dtype} and [N]")
            _check_destinations(dst_rows, output_tokens)
        payload = torch.cat([local_kv, _index_columns(dst_rows.to(local_kv.device), dtype)],
                            dim=1)
        r = self._kv_runner(dtype, payload.shape[1])
        if r is not None and r.fits(payload.shape[0]):
            rows = r.run(payload, slot=ub)  # [W*N, C + k], rank-major
        else:  # over the workspace's share: the fallback, with no empty module call (the
            # gather module cannot take T = 0; every rank's N is the same: all fall back)
            rows = Comm(self.dcp).all_gather(payload).reshape(-1, payload.shape[1])
        dst = rows[:, token_dim:].contiguous().view(torch.int32).reshape(-1).long()
        valid = dst >= 0
        if bool((dst[valid] >= output_tokens).any()):  # a peer's output_tokens was larger
            raise ValueError(f"DCP kv-gather: a destination row is >= output_tokens "
                             f"{output_tokens}")
        row = _duplicate(dst.cpu())  # two ranks naming one row: every rank sees it, raises
        if row is not None:
            raise ValueError(f"DCP kv-gather: two ranks write destination row {row}; each "
                             "row of the output is written by one local row of one rank")
        flat = self._planes[ub, buffer_slot]
        kv_c = flat[: capacity * split].view(capacity, 1, split)
        k_pe = flat[capacity * split:].view(capacity, 1, token_dim - split)
        kv_c[dst[valid], 0] = rows[valid, :split]
        k_pe[dst[valid], 0] = rows[valid, split:token_dim]
        return kv_c[:output_tokens], k_pe[:output_tokens]

    def direct_kv_gather_dma(self, local_kv_c: torch.Tensor, local_k_pe: torch.Tensor,
                             runs: torch.Tensor, output_tokens: int, buffer_slot: int,
                             partner_runs: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """PR #52239's copy-engine variant: the same planes from plane-separated rows and
        ``runs`` [n, 3] (source row, destination row, rows); ``partner_runs`` (the relay's
        route) does not change the result and is not used."""
        if self._layout is None:
            raise RuntimeError("direct DCP KV gather is not enabled")
        dst = torch.full((local_kv_c.shape[0],), -1, dtype=torch.int32)
        for src, to, n in runs.tolist():
            dst[src:src + n] = torch.arange(to, to + n, dtype=torch.int32)
        local = torch.cat([local_kv_c, local_k_pe], dim=1)
        return self.direct_kv_gather(local, dst, output_tokens, buffer_slot)


class MLADCPManagerPR52239(MLADCPKVGather, MLADCPManager):
    """PR #52239's MLADCPManager: the released combine and query gather (MLADCPManager)
    with the PR's KV gather (MLADCPKVGather). Its microbatch count is the PR's
    dcp_kv_gather_ubatch_slots: two when VLLM_K3_UBATCH_PREFILL=1."""

    def __init__(self, vllm_config: Any, device: torch.device | str, num_heads: int,
                 query_head_dim: int, output_head_dim: int, query_dtype: torch.dtype,
                 output_dtype: torch.dtype, padded_num_heads: int | None = None,
                 is_lse_base_on_e: bool = True, use_pcp: bool = False, **kwargs: Any):
        if kwargs.get("num_ubatches") is None and vllm_config is not None:
            split = os.environ.get("VLLM_K3_UBATCH_PREFILL", "0") == "1"
            kwargs["num_ubatches"] = max(vllm_config.parallel_config.num_ubatches,
                                         2 if split else 1)
        MLADCPManager.__init__(self, vllm_config, device, num_heads, query_head_dim,
                               output_head_dim, query_dtype, output_dtype, padded_num_heads,
                               is_lse_base_on_e, use_pcp, **kwargs)
        self._kv_layout_init(None)


__all__ = ["MLADCPKVGather", "MLADCPManagerPR52239"]
