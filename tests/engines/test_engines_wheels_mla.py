"""The model-side code that uses the adapters, run from the released vLLM wheels (every pin
of tests/support/engine_wheels.py: 0.33.0 and 0.34.0), after install(), at W = 2 and 3 on the
``local`` backend, against float64.

tests/engines/test_engines_wheels.py checks that install() rebinds the names; this module runs the
code that then calls them, taken from the wheel's own source (engine_wheels.transplant:
the methods below, compiled from the wheel file into the module of that name, beside the
file's ``from vllm.v1.attention.ops.dcp import`` as the wheel ships it, so install()'s
rebinding reaches them):

- mla_attention.py, ``MLAAttention``: ``process_weights_after_loading`` (the weight
  absorption; on 0.34.0 the all-heads ``W_UV_dcp`` gathered when the manager has
  ``v_up_proj_combine``), ``forward_impl``'s decode path (the query preparation and
  gather, the attention call, the manager's ``combine`` or 0.34.0's
  ``v_up_proj_combine`` into the output slice, the W_UV projection), 0.34.0's
  ``prepare_mqa_query`` (the early gather sized by ``direct_query_gather_max_tokens``);
  ``MLACommonBaseImpl._context_parallel_compute_prefill_context`` (the chunked-context
  prefill: the local gather from the paged cache, the manager's ``kv_gather`` into the
  workspace that ``init_kv_gather`` was given, the wheel's ``reorg_kvcache``, kv_b_proj,
  the attention call) and ``_concat_k_nope_k_pe``; the file's ``split_kv_b_proj``,
  ``_detect_output_quant_key``, ``reorg_kvcache``, ``_get_kv_b_proj_input_dtype``;
- models/kimi_k3/nvidia/mla.py, ``MultiHeadLatentAttention``:
  ``process_weights_after_loading`` (0.34.0: ``W_UV_dcp`` through
  ``dcp_manager.group.all_gather``) and ``_attention``'s decode path (query gather,
  ``v_up_proj_combine`` or ``combine``, the W_UV projection), ``_v_up_proj``;
- attention.py: ``should_load_quant_weights``, ``set_default_quant_scales``.

The manager is built with the keywords the layers pass (the contract test,
test_engines_wheels.py, checks those against the wheel's calls). What the transplanted
code calls that needs CUDA or the whole engine (engine_wheels.load_vllm_model; each
stand-in's reason is in WheelModules.stand_ins, checked against this table):

- vllm.model_executor.layers.attention.mla_attention: current_platform (no
  accelerator), replace_parameter (assigns: vLLM keeps the Parameter for reloading),
  get_dcp_group (this rank's Coordinator), get_and_maybe_dequant_weights (an
  unquantized kv_b_proj's weight), get_attention_context (the layer's metadata of the
  test's forward context), ops (vLLM's CUDA cp_gather_cache, in torch),
  is_quantized_kv_cache ("auto" is not), should_load_quant_weights and
  set_default_quant_scales (the wheel's own, from attention.py);
- vllm.models.kimi_k3.nvidia.mla: the same current_platform, replace_parameter,
  is_quantized_kv_cache, should_load_quant_weights, set_default_quant_scales;
  split_kv_b_proj (the wheel's, from mla_attention.py), is_weights_pre_processed (no
  weight-cache daemon), refill_derived (assigns), get_forward_context (the test's),
  eager_break_during_capture (identity: eager), resolve_quant_method (not reached);
- vllm.model_executor.layers.attention.attention: nothing (the two functions only).

On the layer and impl instances (SimpleNamespace-like attributes the test sets): the
attention kernel ``impl.forward_mqa`` (partials of ALL heads over this rank's KV shard,
in torch fp32, NaN output and LSE -inf for an empty shard: what a kernel leaves there),
the chunked-prefill backend's ``run_prefill_context_chunk`` (attention in torch over the
context it is handed; it records k and v), ``kv_b_proj`` (its weight; called, it records
its input), Kimi's ``_decode_concat_cache`` (the concat of the absorbed query and its
RoPE part: the fused cache insert writes the test's KV, which the attention stand-in
reads directly), and on the Kimi layer nn.Module's ``register_buffer`` (an attribute
assignment: the layer classes run without their nn.Module base). The early gather's
layer is a KV-sharing layer
(``kv_sharing_target_layer_name`` set), so prepare_mqa_query does not call vLLM's KV
cache-update custom op (a CUDA kernel).
"""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import pytest
import torch
from support import engine_wheels as EW

from dcpc.engines import vllm as V
from dcpc.engines import vllm_free as F
from dcpc.runtime.local import LocalGroup

HL, L, R, P, VD = 2, 32, 8, 16, 16  # local heads, kv_lora_rank, rope, nope, v_head_dim
SCALE = 1.0 / math.sqrt(P + R)
LAYER = "model.layers.3.self_attn.attn"
VERSIONS = EW.PINS["vllm"]


class Obj(types.SimpleNamespace):
    """An instance for the transplanted methods: attributes set by the test."""


@pytest.fixture
def dcpc_state(monkeypatch):
    for var in ("DCPC_MAX_NUM_TOKENS", "VLLM_USE_DIRECT_DCP_A2A", "DCPC_VLLM_AG_RS",
                "VLLM_USE_DIRECT_DCP_Q_GATHER", "VLLM_USE_DIRECT_DCP_KV_GATHER",
                "DCPC_BACKEND", "DCPC_CAPTURE_SIZES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(F, "_originals", {})
    monkeypatch.setattr(F, "_installed_tokens", [])
    V.forget_config()
    yield
    V.forget_config()


def _config(backend: str) -> Any:
    """The fields of VllmConfig that vLLM's manager and workspace formula read."""
    ns = types.SimpleNamespace
    return ns(parallel_config=ns(num_ubatches=1, dcp_comm_backend=backend),
              scheduler_config=ns(max_num_batched_tokens=64, max_num_seqs=16),
              speculative_config=None, num_speculative_tokens=0, use_v2_model_runner=False,
              compilation_config=ns(max_cudagraph_capture_size=None,
                                    cudagraph_capture_sizes=None),
              kernel_config=ns(enable_jit_warmup=False))


def _setup(world: int, tokens: int, seed: int) -> dict[str, Any]:
    """Global weights and one decode batch: ``tokens`` requests of one query token each,
    request 0 of length 1 (ranks 1.. hold none of it: an empty shard)."""
    g = torch.Generator().manual_seed(seed)
    heads = HL * world
    kv_b = (torch.randn(heads, P + VD, L, generator=g) * 0.3).bfloat16()  # [H, P+V, L]
    lens = [1] + [int(torch.randint(2, 9, (1,), generator=g)) for _ in range(tokens - 1)]
    kv_c = [torch.randn(n, L, generator=g).bfloat16() for n in lens]
    k_pe = [torch.randn(n, R, generator=g).bfloat16() for n in lens]
    q = (torch.randn(tokens, heads, P + R, generator=g) * 0.5).bfloat16()
    return {"kv_b": kv_b, "lens": lens, "kv_c": kv_c, "k_pe": k_pe, "q": q, "world": world}


def _reference(x: dict[str, Any], rank: int) -> torch.Tensor:
    """float64: the MLA decode output of this rank's heads [B, HL*V] over every token."""
    kv_b = x["kv_b"].double()
    w_uk, w_uv = kv_b[:, :P, :], kv_b[:, P:, :]  # [H, P, L], [H, V, L]
    rows = []
    for b in range(len(x["lens"])):
        kv, pe = x["kv_c"][b].double(), x["k_pe"][b].double()
        per_head = []
        for h in range(rank * HL, (rank + 1) * HL):
            q = x["q"][b, h].double()
            ql = q[:P] @ w_uk[h]  # [L]
            score = (kv @ ql + pe @ q[P:]) * SCALE
            latent = torch.softmax(score, 0) @ kv
            per_head.append(w_uv[h] @ latent)
        rows.append(torch.cat(per_head))
    return torch.stack(rows)


def _local(x: dict[str, Any], rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's KV shard of every request (token t on rank t % W)."""
    w = x["world"]
    return ([kv[rank::w] for kv in x["kv_c"]], [pe[rank::w] for pe in x["k_pe"]])


def _forward_mqa(x: dict[str, Any], rank: int):
    """The attention kernel: partials of all heads over this rank's KV shard."""
    kv_loc, pe_loc = _local(x, rank)

    def forward_mqa(mqa_q, kv_cache, attn_metadata, layer):
        tokens, heads, _ = mqa_q.shape
        out = torch.full((tokens, heads, L), float("nan"), dtype=torch.bfloat16)
        lse = torch.full((tokens, heads), float("-inf"))
        for b in range(tokens):
            kv, pe = kv_loc[b].float(), pe_loc[b].float()
            if kv.shape[0] == 0:
                continue  # an empty shard: garbage output, LSE -inf
            q = mqa_q[b].float()  # [H, L + R]
            score = (q[:, :L] @ kv.T + q[:, L:] @ pe.T) * SCALE
            out[b] = (torch.softmax(score, -1) @ kv).bfloat16()
            lse[b] = torch.logsumexp(score, -1)
        return out, lse

    return forward_mqa


def _metadata(x: dict[str, Any], rank: int) -> Any:
    ns, w = types.SimpleNamespace, x["world"]
    local = torch.tensor([(n - rank + w - 1) // w for n in x["lens"]], dtype=torch.int32)
    tokens = len(x["lens"])
    return ns(num_actual_tokens=tokens, num_decodes=tokens, num_prefills=0,
              num_decode_tokens=tokens, seq_lens=local, prefill=None,
              query_start_loc=torch.arange(tokens + 1, dtype=torch.int32),
              decode=ns(seq_lens=local))


def _manager(mods: EW.WheelModules, module: str, backend: str) -> Any:
    """The manager as the layer's __init__ builds it (vLLM's keywords), through the name
    the layer's module holds (dcpc's after install())."""
    cls = vars(sys.modules[module])["MLADCPManager"]
    assert cls is V.MLADCPManager
    return cls(vllm_config=_config(backend), device=torch.device("cpu"), num_heads=HL,
               query_head_dim=L + R, output_head_dim=L, query_dtype=torch.bfloat16,
               output_dtype=torch.bfloat16, padded_num_heads=None, is_lse_base_on_e=True,
               use_pcp=False)


def _scales() -> dict[str, torch.Tensor]:
    return {k: torch.tensor(2.0) for k in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")}


class Proj:
    """kv_b_proj: a callable module with a weight (records its inputs)."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.params_dtype, self.seen = weight, weight.dtype, []

    def __call__(self, inp: torch.Tensor) -> tuple[torch.Tensor]:
        self.seen.append(inp.clone())
        return ((inp.float() @ self.weight.float().T).to(inp.dtype),)


def _mla_layer(mods: EW.WheelModules, x: dict[str, Any], rank: int, backend: str) -> Any:
    """MLAAttention (the wheel's methods) with the attributes its __init__ sets."""
    cls = vars(sys.modules[EW.MLA])["MLAAttention"]
    layer = cls()
    w = x["world"]
    impl = Obj(dcp_world_size=w, pcp_world_size=1, is_sparse=False, lse_base_on_e=True,
               supports_quant_query_input=False, forward_mqa=_forward_mqa(x, rank),
               process_weights_after_loading=lambda dtype: None)
    vars(layer).update(
        impl=impl, num_heads=HL, kv_lora_rank=L, qk_rope_head_dim=R, qk_nope_head_dim=P,
        v_head_dim=VD, q_pad_num_heads=None, kv_cache_dtype="auto", act_dtype=torch.bfloat16,
        kv_b_proj=Proj(x["kv_b"][rank * HL:(rank + 1) * HL].reshape(HL * (P + VD), L)),
        quant_config=None, layer_name=LAYER, use_pcp=False, prefill_backend=None,
        dcp_q_replicate=False, is_aiter_triton_fp4_bmm_enabled=False,
        is_aiter_triton_fp8_bmm_enabled=False, is_amx_bmm_enabled=False, W_UV_dcp=None,
        W_UK_T_dcp_qrep=None, hisparse_cache=None, kv_sharing_target_layer_name=None,
        _decode_concat_quant_fp8_op=None, **_scales())
    layer.dcp_manager = _manager(mods, EW.MLA, backend)
    return layer


def _load_weights(layer: Any) -> None:
    """process_weights_after_loading as vLLM's loader calls it (0.33.0's MLAAttention
    takes the activation dtype, 0.34.0's reads self.act_dtype)."""
    import inspect

    params = inspect.signature(layer.process_weights_after_loading).parameters
    if "act_dtype" in params:
        layer.process_weights_after_loading(torch.bfloat16)
    else:
        layer.process_weights_after_loading()


def _run(world: int, fn) -> list:
    return LocalGroup(world, "cpu", timeout_s=300).run(lambda rank: fn(rank, rank.rank))


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 3e-2) -> float:
    """bf16 layers against float64: NaN never passes; returns the largest error."""
    got, want = got.detach().double(), want.double()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not torch.isnan(got).any(), "NaN in the result"
    err = (got - want).abs().max().item()
    assert torch.allclose(got, want, atol=tol, rtol=tol), err
    return err


@pytest.fixture(params=VERSIONS)
def vllm_model(request, dcpc_state):
    mods = EW.load_vllm_model(request.param)
    V.install()
    try:
        yield request.param, mods
    finally:
        mods.close()


@pytest.mark.parametrize("world", [2, 3])
def test_mla_attention_weight_loading_and_decode(vllm_model, world):
    """MLAAttention from the wheel: weight loading, then two decode forwards (4 and 9
    tokens: vLLM 0.34.0's W_UV-fused merge merges the latent first below 8 tokens and
    the up-projected values from 8 up), the output of this rank's heads against
    float64; on 0.34.0 also prepare_mqa_query's early gather, whose result the forward
    then uses. The a2a path (0.34.0: v_up_proj_combine) and the ag_rs path (combine)."""
    version, mods = vllm_model
    new = version != "0.33.0"
    runs = [(4, "a2a", 11), (9, "a2a", 12), (9, "ag_rs", 13)]
    data = {seed: _setup(world, tokens, seed) for tokens, _, seed in runs}

    def rank_main(rank, r):
        EW.set_group(rank)
        got = {}
        for tokens, backend, seed in runs:
            x = data[seed]
            layer = _mla_layer(mods, x, r, backend)
            _load_weights(layer)
            fused = layer.dcp_manager.v_up_proj_combine is not None
            assert fused == (backend == "a2a"), backend  # as vLLM 0.34.0's NCCL path
            has_wuv_dcp = layer.W_UV_dcp is not None
            q = x["q"][:, r * HL:(r + 1) * HL].contiguous()
            md = _metadata(x, r)
            out = torch.full((tokens, HL * VD), float("nan"), dtype=torch.bfloat16)
            got[(seed, "forward")] = layer.forward_impl(
                q, torch.zeros(tokens, L).bfloat16(), torch.zeros(tokens, R).bfloat16(),
                None, md, out).clone()
            got[(seed, "wuv")] = (has_wuv_dcp, fused)
            if new:  # the early gather: its result is the forward's query
                EW.forward.context = types.SimpleNamespace(
                    attn_metadata={LAYER: md}, slot_mapping={LAYER: None})
                layer.kv_sharing_target_layer_name = "model.layers.0.self_attn.attn"
                assert layer.dcp_manager.direct_query_gather_max_tokens == 16
                prepared = layer.prepare_mqa_query(q, None, None)  # no KV write: shared
                assert prepared is not None and prepared.shape == (tokens, HL * world, L + R)
                out2 = torch.full_like(out, float("nan"))
                got[(seed, "prepared")] = layer.forward_impl(
                    q, torch.zeros(tokens, L).bfloat16(), torch.zeros(tokens, R).bfloat16(),
                    None, md, out2, mqa_q_prepared=prepared).clone()
        return got

    results = _run(world, rank_main)
    for r, got in enumerate(results):
        for _, _, seed in runs:
            want = _reference(data[seed], r)
            _close(got[(seed, "forward")], want)
            has_wuv_dcp, fused = got[(seed, "wuv")]
            # 0.34.0 gathers W_UV_dcp exactly when the merge uses it; 0.33.0 never
            assert has_wuv_dcp == (fused and new), (version, seed)
            if new:
                _close(got[(seed, "prepared")], want)


def test_kimi_k3_layer_weight_loading_and_decode(vllm_model):
    """Kimi-K3's NVIDIA MLA layer from the wheel (W = 3, a2a, 9 tokens): weight loading
    (0.34.0: W_UV of every head through dcp_manager.group.all_gather), then _attention's
    decode path, against float64."""
    version, mods = vllm_model
    world, tokens = 3, 9
    x = _setup(world, tokens, 21)
    cls = vars(sys.modules[EW.KIMI])["MultiHeadLatentAttention"]

    def rank_main(rank, r):
        EW.set_group(rank)
        layer = cls()
        impl = Obj(forward_mqa=_forward_mqa(x, r))
        vars(layer).update(
            impl=impl, num_local_heads=HL, kv_lora_rank=L, qk_rope_head_dim=R,
            qk_nope_head_dim=P, v_head_dim=VD, act_dtype=torch.bfloat16, quant_config=None,
            kv_b_proj=Proj(x["kv_b"][r * HL:(r + 1) * HL].reshape(HL * (P + VD), L)),
            layer_name=LAYER, dcp_world_size=world, rotary_emb=None, W_UV_dcp=None,
            kv_cache=None, kv_cache_dtype="auto", **_scales())
        layer._decode_concat_cache = lambda ql, pe, *rest: torch.cat([ql, pe], -1)
        # nn.Module's register_buffer (0.33.0 keeps the inverse scales so): an attribute
        layer.register_buffer = lambda name, t, persistent=True: setattr(layer, name, t)
        layer._attn_read_kv_cache = lambda: None
        layer.dcp_manager = _manager(mods, EW.KIMI, "a2a")
        _load_weights(layer)
        EW.forward.context = types.SimpleNamespace(
            attn_metadata={LAYER: _metadata(x, r)},  # the slots: ignored by the stand-in
            slot_mapping={LAYER: torch.arange(tokens)})
        out = torch.full((tokens, HL * VD), float("nan"), dtype=torch.bfloat16)
        q = x["q"][:, r * HL:(r + 1) * HL].contiguous()
        layer._attention(torch.arange(tokens), q, torch.zeros(tokens, L).bfloat16(),
                         torch.zeros(tokens, R).bfloat16(), out)
        return out, layer.W_UV_dcp is not None

    for r, (out, gathered) in enumerate(_run(world, rank_main)):
        _close(out, _reference(x, r))
        assert gathered == (version != "0.33.0")


class PrefillBackend:
    """The chunked-prefill backend's run_prefill_context_chunk: attention of each
    request's query rows over the context it is handed (torch, fp32), recording k, v."""

    def __init__(self, cu_context: list[int], cu_query: list[int]):
        self.cu_context, self.cu_query, self.seen = cu_context, cu_query, []

    def run_prefill_context_chunk(self, chunk, q, k, v):
        self.seen.append((k.clone(), v.clone()))
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.empty(q.shape[1], q.shape[0])
        for i in range(len(self.cu_context) - 1):
            kk = k[self.cu_context[i]:self.cu_context[i + 1]].float()  # [N, H, P + R]
            vv = v[self.cu_context[i]:self.cu_context[i + 1]].float()
            rows = slice(self.cu_query[i], self.cu_query[i + 1])
            score = torch.einsum("thd,nhd->htn", q[rows].float(), kk) * SCALE
            out[rows] = torch.einsum("htn,nhv->thv", torch.softmax(score, -1), vv)
            lse[:, rows] = torch.logsumexp(score, -1)
        return out, lse


@pytest.mark.parametrize("world", [2, 3])
def test_chunked_context_kv_gather(vllm_model, world):
    """The chunked-context prefill of MLACommonBaseImpl from the wheel (W = 2, 3): the
    workspace the metadata builder allocates and hands to init_kv_gather, the local
    gather from the paged cache, the manager's kv_gather, the wheel's reorg_kvcache and
    kv_b_proj: every context token of every rank reaches kv_b_proj and the attention,
    bit for bit, in reorg_kvcache's order, and the context attention matches float64."""
    version, mods = vllm_model
    heads = HL * world
    g = torch.Generator().manual_seed(31)
    lens, queries = [5, 1, 7], [2, 1, 3]  # context tokens, query tokens per request
    ctx = [torch.randn(n, L + R, generator=g).bfloat16() for n in lens]
    q = torch.randn(sum(queries), HL, P + R, generator=g).bfloat16()
    kv_b = (torch.randn(heads, P + VD, L, generator=g) * 0.3).bfloat16()
    cu_ctx = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu_q = [0, *torch.tensor(queries).cumsum(0).tolist()]
    padded = [(n + world - 1) // world for n in lens]  # vLLM's padded_rows at interleave 1
    workspace_tokens = 8 * world  # a multiple of W, as vLLM asserts
    impl_cls = vars(sys.modules[EW.MLA])["MLACommonBaseImpl"]

    def rank_main(rank, r):
        EW.set_group(rank)
        manager = _manager(mods, EW.MLA, "a2a")
        # the metadata builder's workspace and init_kv_gather, as vLLM's __init__ calls it
        workspace = torch.empty(workspace_tokens + workspace_tokens // world, L + R,
                                dtype=torch.bfloat16)
        manager.init_kv_gather(workspace, workspace_tokens)
        cache = torch.zeros(len(lens), max(padded), L + R, dtype=torch.bfloat16)
        for i, rows in enumerate(ctx):  # this rank's tokens t % W == r, block i
            cache[i, : rows[r::world].shape[0]] = rows[r::world]
        local = [[(n - s + world - 1) // world for s in range(world)] for n in lens]
        chunk = types.SimpleNamespace(
            padded_local_seq_lens=padded, local_context_lens_allranks=local,
            padded_local_cu_seq_lens=torch.tensor([0, *torch.tensor(padded).cumsum(0)
                                                   .tolist()], dtype=torch.int32),
            padded_local_token_to_seq=torch.repeat_interleave(
                torch.arange(len(lens)), torch.tensor(padded)).int(),
            local_starts=[0] * len(lens), num_local_context_tokens=sum(padded),
            request_slice=slice(0, len(lens)), token_slice=slice(0, sum(queries)),
            starts=torch.zeros(len(lens), dtype=torch.int32), num_requests=len(lens),
            num_context_tokens=sum(lens), max_seq_len=max(lens))
        backend = PrefillBackend(cu_ctx, cu_q)
        md = types.SimpleNamespace(prefill=types.SimpleNamespace(
            prefill_backend=backend, q_data_type=torch.bfloat16,
            block_table=torch.arange(len(lens)).view(-1, 1),
            chunked_context=types.SimpleNamespace(
                workspace=workspace, chunks=[chunk], empty_token_slices=[],
                dcp_manager=manager)))
        impl = impl_cls()
        proj = Proj(kv_b[r * HL:(r + 1) * HL].reshape(HL * (P + VD), L))
        vars(impl).update(kv_b_proj=proj, kv_cache_dtype="auto", kv_lora_rank=L,
                          qk_rope_head_dim=R, num_heads=HL, qk_nope_head_dim=P,
                          v_head_dim=VD, _use_flashinfer_concat_mla_k=False)
        out, lse = impl._context_parallel_compute_prefill_context(
            q, cache, md, torch.tensor(1.0), world)
        return proj.seen, backend.seen, out

    # every request's context, each rank's tokens (t % W == s) in turn: the order of
    # vLLM's reorg_kvcache (the context attention does not depend on the keys' order)
    full = torch.cat([rows[s::world] for rows in ctx for s in range(world)])
    for r, (proj_in, attn_in, out) in enumerate(_run(world, rank_main)):
        assert len(proj_in) == 1 and torch.equal(proj_in[0].reshape(-1, L), full[:, :L])
        k, v = attn_in[0]
        for h in range(HL):  # the RoPE part of every head's key: the gathered k_pe
            assert torch.equal(k[:, h, P:], full[:, L:])
        w = kv_b[r * HL:(r + 1) * HL].double()  # float64: kv_b_proj, then attention
        kv = full.double()
        k_nope = torch.einsum("nl,hpl->nhp", kv[:, :L], w[:, :P])
        v64 = torch.einsum("nl,hvl->nhv", kv[:, :L], w[:, P:])
        k64 = torch.cat([k_nope, kv[:, None, L:].expand(-1, HL, R)], -1)
        want = torch.empty(sum(queries), HL, VD, dtype=torch.float64)
        for i in range(len(lens)):
            rows = slice(cu_q[i], cu_q[i + 1])
            score = torch.einsum("thd,nhd->htn", q[rows].double(),
                                 k64[cu_ctx[i]:cu_ctx[i + 1]]) * SCALE
            want[rows] = torch.einsum("htn,nhv->thv", torch.softmax(score, -1),
                                      v64[cu_ctx[i]:cu_ctx[i + 1]])
        _close(out, want)


def test_the_stand_in_table_names_every_stand_in():
    """Every global the transplanted code gets from a stand-in is named in this module's
    table under its module, and every module the loader cut down is named."""
    doc = " ".join((__doc__ or "").split())
    mods = EW.load_vllm_model(VERSIONS[-1])
    try:
        assert mods.stand_ins
        for module, names in mods.stand_ins.items():
            section = doc.split(f"- {module}:", 1)
            assert len(section) == 2, module
            text = section[1].split("\n- ", 1)[0].split(" - vllm.", 1)[0]
            for name in names:
                assert name in text, (module, name)
    finally:
        mods.close()
