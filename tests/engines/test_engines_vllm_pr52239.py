"""The DCP layout of open vLLM PR #52239 (vllm.v1.attention.ops.dcp_utils, in no release;
MLADCPKVGather with init_kv_gather(max_gathered_tokens, token_dim, plane_split_dim,
dtype) and direct_kv_gather): install() recognises it and patches every binding, the
adapters take the PR's signatures, and the PR's KV gather returns what the PR's code
returns, on dcpc's kernels (local backend, W = 2 and 3) against the rows it must move,
bit for bit. vLLM's modules are stand-ins (tests/support/vllm_layouts.py says what is excerpted
and what is stubbed)."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from support import vllm_layouts as L
from support.kernels import run_ranks

from dcpc.engines import common
from dcpc.engines import vllm as V
from dcpc.engines import vllm_free as F
from dcpc.engines.vllm_kv import MLADCPKVGather, MLADCPManagerPR52239
from dcpc.runtime.errors import DcpcArgumentError, DcpcPeerFailedError
from dcpc.runtime.local import LocalGroup


@pytest.fixture
def vllm_main(monkeypatch):
    tree = L.modules()
    for name, module in tree.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.ops.dcp", None)  # main has none
    monkeypatch.setattr(F, "_originals", {})
    monkeypatch.setattr(common, "_logged", set())
    L.CALLS.clear()
    orig = {}  # install() rebinds every module's binding, this stand-in file's too
    for name in ("cp_lse_ag_out_rs", "cp_lse_ag_out_ar", "dcp_a2a_lse_reduce",
                 "MLADCPKVGather", "MLADCPManager"):
        orig[name] = getattr(L, name)
        monkeypatch.setattr(L, name, orig[name])  # restored after the test
    tree["orig"] = orig
    return tree


def test_install_recognises_the_pr_layout_and_rebinds_every_binding(vllm_main, caplog):
    with caplog.at_level("INFO", logger="dcpc.engines"):
        patched = V.install()
    utils = vllm_main["vllm.v1.attention.ops.dcp_utils"]
    assert utils.MLADCPManager is MLADCPManagerPR52239
    assert utils.MLADCPKVGather is MLADCPKVGather
    assert vllm_main["vllm.model_executor.layers.attention.mla_attention"].MLADCPManager \
        is MLADCPManagerPR52239
    assert vllm_main["vllm.v1.attention.ops.common"].cp_lse_ag_out_rs is V.cp_lse_ag_out_rs
    assert vllm_main["vllm.v1.attention.ops.dcp_alltoall"].dcp_a2a_lse_reduce \
        is V.dcp_a2a_lse_reduce
    assert utils.dcp_a2a_lse_reduce is V.dcp_a2a_lse_reduce
    orig = vllm_main["orig"]
    assert utils.cp_lse_ag_out_ar is orig["cp_lse_ag_out_ar"]  # kept: vLLM's own
    assert {"vllm.v1.attention.ops.dcp_utils.MLADCPKVGather",
            "vllm.v1.attention.ops.common.cp_lse_ag_out_rs",
            "vllm.v1.attention.ops.dcp_alltoall.dcp_a2a_lse_reduce"} <= set(patched)
    assert F._originals["MLADCPManager"] is orig["MLADCPManager"]
    assert F._originals["cp_lse_ag_out_ar"] is orig["cp_lse_ag_out_ar"]
    assert V.install() == []  # idempotent
    assert any("open vLLM PR #52239's layout (vllm.v1.attention.ops.dcp_utils, "
               "unreleased)" in r.getMessage() for r in caplog.records)


def _public(cls: type) -> dict[str, object]:
    return {n: v for c in reversed(cls.__mro__) for n, v in vars(c).items()
            if not n.startswith("_") and c is not object}


def _params(fn: object) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.KEYWORD_ONLY)]


@pytest.mark.parametrize(("theirs", "ours"), [(L.MLADCPKVGather, MLADCPKVGather),
                                              (L.MLADCPManager, MLADCPManagerPR52239)])
def test_the_adapters_take_mains_signatures(theirs, ours):
    mine = _public(ours)
    for name, value in _public(theirs).items():
        assert name in mine, name
        if isinstance(value, property):
            assert isinstance(mine[name], property), name
        elif callable(value):
            assert _params(mine[name])[: len(_params(value))] == _params(value), name
    assert _params(ours.__init__)[: len(_params(theirs.__init__))] == _params(theirs.__init__)
    for fn in ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce"):  # the PR's extra keywords: **kwargs
        V_params = inspect.signature(getattr(V, fn)).parameters
        assert all(p in V_params or any(q.kind == q.VAR_KEYWORD for q in V_params.values())
                   for p in inspect.signature(getattr(L, fn)).parameters), fn


def test_a_b12x_keyword_takes_vllms_own_path(vllm_main):
    V.install()
    out, lse = torch.randn(2, 4, 8).bfloat16(), torch.randn(2, 4)
    got = V.dcp_a2a_lse_reduce(out, lse, "group", use_b12x=True, b12x_max_batch_size=8)
    assert got == "vllm dcp_a2a_lse_reduce"
    name, args, kwargs = L.CALLS[-1]
    assert args[0] is out and args[1] is lse and args[2] == "group"
    assert kwargs["use_b12x"] is True and kwargs["b12x_max_batch_size"] == 8
    F._originals.clear()  # not installed: refused, never silently run another way
    with pytest.raises(DcpcArgumentError, match="use_b12x asks for vLLM's own path"):
        V.dcp_a2a_lse_reduce(out, lse, "group", use_b12x=True)


def test_a_function_with_another_argument_order_is_left_alone_once(vllm_main, caplog):
    """vLLM's older dcp_a2a_lse_reduce(local_output, local_lse, kvp_group, return_lse,
    is_lse_base_on_e) (vllm-project/vllm 03752bec): dcpc's (.., ctx, return_lse, ..) would
    bind return_lse to ctx: that function stays vLLM's, said once with what differs; the
    pieces whose contract dcpc holds are still replaced."""
    def dcp_a2a_lse_reduce(local_output, local_lse, kvp_group, return_lse=False,
                           is_lse_base_on_e=True):
        return "old"

    utils = vllm_main["vllm.v1.attention.ops.dcp_utils"]
    utils.dcp_a2a_lse_reduce = dcp_a2a_lse_reduce
    with caplog.at_level("WARNING", logger="dcpc.engines"):
        patched = V.install()
        V.install()
    assert utils.dcp_a2a_lse_reduce is dcp_a2a_lse_reduce
    assert not [p for p in patched if p.endswith(".dcp_a2a_lse_reduce")], patched
    assert utils.MLADCPManager is MLADCPManagerPR52239
    said = [r.getMessage() for r in caplog.records if "stays" in r.getMessage()]
    assert len(said) == 1, said
    assert "vLLM's own dcp_a2a_lse_reduce stays" in said[0]
    assert "parameter 'return_lse' is vLLM's positional argument 3, not dcpc's" in said[0]


def test_a_vllm_module_that_fails_to_import_leaves_vllms_path(vllm_main, monkeypatch,
                                                               caplog):
    """Not only ImportError: an engine module that raises anything while importing (a
    missing CUDA library, an env check) must not crash the engine's plugin loader."""
    import importlib

    real = importlib.import_module

    def failing(name, *args):
        if name.startswith("vllm.v1.attention.ops."):
            raise RuntimeError("libcuda.so.1: cannot open shared object file")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", failing)
    with caplog.at_level("WARNING", logger="dcpc.engines"):
        assert V.install() == []
    said = [r.getMessage() for r in caplog.records if "own DCP path stays" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: libcuda.so.1" in said[0], said
    assert vllm_main["vllm.v1.attention.ops.dcp_utils"].MLADCPManager \
        is vllm_main["orig"]["MLADCPManager"]


# ---- PR #52239's KV gather on dcpc's kernels (local backend) ---------------------------------
def _maps(world: int) -> tuple[list[list[int]], int]:
    """Per rank, local row -> compact row (-1: padding). W = 2: the PR's own example
    (test_dcp_final_layout_dst_rows_maps_padding_and_continuations); W = 3: a shuffled
    map of the same shape (5 local rows, some padding)."""
    if world == 2:
        return [[0, 1, 2, 3, 7, 8, 9], [4, 5, 6, -1, 10, -1, -1]], 11
    g = torch.Generator().manual_seed(3)
    valid = [5, 2, 4]
    order = torch.randperm(sum(valid), generator=g).tolist()
    maps, at = [], 0
    for v in valid:
        rows = order[at:at + v] + [-1] * (5 - v)
        at += v
        perm = torch.randperm(5, generator=g).tolist()
        maps.append([rows[i] for i in perm])
    return maps, sum(valid)


def _runs(dst: list[int]) -> torch.Tensor:
    runs: list[list[int]] = []
    for i, d in enumerate(dst):
        if d < 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([i, d, 1])
    return torch.tensor(runs or [[0, 0, 0]], dtype=torch.int64)


TOKEN_DIM, SPLIT = 24, 16


def _locals(world: int, rows: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(rows, TOKEN_DIM, generator=g) * 4).to(dtype) for _ in range(world)]


def _kv_rank(rank, world: int, dtype: torch.dtype, manager: bool) -> dict:
    maps, out_tokens = _maps(world)
    rows = len(maps[0])
    local = _locals(world, rows, dtype)
    r = rank.rank
    capacity = world * 8
    if manager:  # the PR's MLADCPManager: the KV gather of MLADCPKVGather (the combine and
        m = MLADCPManagerPR52239(None, "cpu", 2, 16, 16, torch.bfloat16, torch.bfloat16,  # query
                              group=rank, max_num_tokens=8, num_ubatches=1,  # gather off)
                              comm_backend="a2a")
    else:
        m = MLADCPKVGather(rank, "cpu", 1)
    found: dict = {"direct": m.init_kv_gather(capacity, TOKEN_DIM, SPLIT, dtype),
                   "slots": m.kv_gather_slots}
    if not found["direct"]:
        gathered = torch.full((world * rows, TOKEN_DIM), float("nan")).to(dtype)
        m.kv_gather(gathered, local[r])
        found["rank_major"] = gathered
        return found
    dst = torch.tensor(maps[r], dtype=torch.int32)
    m._planes.fill_(float("nan"))  # poison: a row not written shows
    kv_c, k_pe = m.direct_kv_gather(local[r], dst, out_tokens, 0)
    found["planes"] = (kv_c.clone(), k_pe.clone(), kv_c.shape, k_pe.shape)
    kv_c1, k_pe1 = m.direct_kv_gather_dma(local[r][:, :SPLIT].contiguous(),
                                          local[r][:, SPLIT:].contiguous(),
                                          _runs(maps[r]), out_tokens, 1)
    found["dma"] = (kv_c1.clone(), k_pe1.clone())
    found["slot0_kept"] = bool(torch.equal(kv_c.view(torch.uint8),
                                           found["planes"][0].view(torch.uint8)))
    try:
        m.kv_gather(torch.empty(world * rows, TOKEN_DIM, dtype=dtype), local[r])
    except RuntimeError as err:
        found["kv_gather"] = str(err)
    return found


def _expected(world: int, dtype: torch.dtype) -> torch.Tensor:
    maps, out_tokens = _maps(world)
    local = _locals(world, len(maps[0]), dtype)
    want = torch.empty(out_tokens, TOKEN_DIM, dtype=dtype)
    for r, dst in enumerate(maps):
        for i, d in enumerate(dst):
            if d >= 0:
                want[d] = local[r][i]
    return want


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


@pytest.mark.parametrize(("world", "dtype"), [(2, torch.bfloat16), (3, torch.float8_e4m3fn)])
def test_direct_kv_gather_returns_mains_compact_planes(world, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_KV_GATHER", "1")
    found = run_ranks(world,
        lambda rank: _kv_rank(rank, world, dtype, manager=False))
    want = _expected(world, dtype)
    n = want.shape[0]
    for r, f in enumerate(found):
        assert f["direct"] is True and f["slots"] == 2, (r, f)
        kv_c, k_pe, kv_shape, pe_shape = f["planes"]
        assert kv_shape == (n, 1, SPLIT) and pe_shape == (n, 1, TOKEN_DIM - SPLIT)
        assert _same(kv_c[:, 0], want[:, :SPLIT]) and _same(k_pe[:, 0], want[:, SPLIT:]), r
        assert _same(f["dma"][0][:, 0], want[:, :SPLIT]), r
        assert _same(f["dma"][1][:, 0], want[:, SPLIT:]), r
        assert f["slot0_kept"], r  # slot 1's gather left slot 0's planes alone
        assert f["kv_gather"] == "NCCL DCP KV gather is not selected", r


@pytest.mark.parametrize("switch", ["auto", "0"])
def test_init_kv_gather_auto_and_off_select_the_rank_major_gather(switch, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_A2A", "0")  # the manager's combine and query
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_Q_GATHER", "0")  # gather: not built here
    if switch == "auto":
        monkeypatch.delenv("VLLM_USE_DIRECT_DCP_KV_GATHER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_DIRECT_DCP_KV_GATHER", switch)
    found = run_ranks(2,
        lambda rank: _kv_rank(rank, 2, torch.bfloat16, manager=True))
    local = _locals(2, 7, torch.bfloat16)
    for r, f in enumerate(found):
        assert f["direct"] is False and f["slots"] == 0, (r, f)
        assert _same(f["rank_major"], torch.cat(local)), r


def test_init_kv_gather_checks_as_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))

    def rank_main(rank):
        m = MLADCPKVGather(rank, "cpu", 1)
        errors = []
        for args in ((15, 24, 16, torch.bfloat16), (0, 24, 16, torch.bfloat16),
                     (16, 0, 16, torch.bfloat16)):
            try:
                m.init_kv_gather(*args)
            except ValueError as err:
                errors.append(str(err))
        try:
            m.direct_kv_gather(torch.zeros(2, 24), torch.zeros(2), 2, 0)
        except RuntimeError as err:
            errors.append(str(err))
        return errors

    errors = LocalGroup(2, "cpu", timeout_s=60).run(rank_main)[0]
    assert "divide evenly across 2 ranks, got 15" in errors[0]
    assert "got 0" in errors[1] and "token dimension must be positive: 0" in errors[2]
    assert errors[3] == "direct DCP KV gather is not enabled"


def _bad_dst_rank(rank, bad: dict) -> dict:
    """W=2, 7 local rows each (capacity 16): rank r passes ``bad.get(r)`` as its
    dst_rows (else the good map); what direct_kv_gather returned or raised."""
    maps, out_tokens = _maps(2)
    local = _locals(2, 7, torch.bfloat16)
    m = MLADCPKVGather(rank, "cpu", 1)
    try:  # init's warm-up gathers: a rank still in them when its peer already refused
        # its arguments sees that peer's failure flag there (the peer's signal arrived,
        # then it failed): that rank's error comes from init, not from the gather
        assert m.init_kv_gather(16, TOKEN_DIM, SPLIT, torch.bfloat16)
    except DcpcPeerFailedError as err:
        return {"error": (type(err).__name__, str(err))}
    r = rank.rank
    dst = bad.get(r, torch.tensor(maps[r], dtype=torch.int32))
    m._planes.fill_(float("nan"))
    try:
        kv_c, k_pe = m.direct_kv_gather(local[r], dst, out_tokens, 0)
    except Exception as err:  # noqa: BLE001 (the test asserts on it)
        return {"error": (type(err).__name__, str(err))}
    return {"kv_c": kv_c.clone(), "k_pe": k_pe.clone()}


GOOD0 = [0, 1, 2, 3, 7, 8, 9]  # _maps(2)[0][0]: rank 0's destinations


@pytest.mark.parametrize(("dst", "words"), [
    (torch.tensor([2**32, 1, 2, 3, 7, 8, 9]), r"dst_rows\[0\] = 4294967296 is outside 0..10"),
    (torch.tensor([0.9, 1, 2, 3, 7, 8, 9]), "dst_rows must hold integer row numbers, got "
                                            "torch.float32"),
    (torch.tensor([0, 1, 2, 3, 7, 8, 8]), "dst_rows names destination row 8 twice"),
    (torch.tensor([-2, 1, 2, 3, 7, 8, 9]), r"dst_rows\[0\] = -2 is outside 0..10"),
    (torch.tensor([0, 1, 2, 3, 7, 8, 11]), r"dst_rows\[6\] = 11 is outside 0..10"),
], ids=["int64-2**32", "float", "duplicate", "minus-2", "past-output"])
def test_direct_kv_gather_refuses_destinations_that_are_not_rows(dst, words, tmp_path,
                                                                 monkeypatch):
    """Before, each of these landed somewhere silently: 2**32 and 0.9 on row 0 (the int32
    cast before the bounds check), over rank 1's token there; a duplicate overwrote; -2
    was dropped like -1. Now rank 0 refuses its arguments before anything moves, and its
    peer's gather stops with an error instead of returning."""
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_KV_GATHER", "1")
    found = run_ranks(2,
        lambda rank: _bad_dst_rank(rank, {0: dst}))
    kind, message = found[0]["error"]
    assert kind == "ValueError", found[0]
    import re

    assert re.search(words, message), message
    assert "error" in found[1], found[1]  # the peer's call fails too (never data)


def test_two_ranks_naming_one_row_are_refused_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_KV_GATHER", "1")
    clash = torch.tensor([4, 5, 6, -1, 10, 0, -1], dtype=torch.int32)  # row 0 is rank 0's
    found = run_ranks(2,
        lambda rank: _bad_dst_rank(rank, {1: clash}))
    for f in found:
        assert f.get("error") == ("ValueError", "DCP kv-gather: two ranks write destination "
                                  "row 0; each row of the output is written by one local row "
                                  "of one rank"), f


def _over_share_rank(rank) -> dict:
    """capacity 12 at W=2: a share of 6 rows per rank; each rank passes 7 (the 11 output
    rows fit the capacity): the documented fallback (torch collectives) moves them."""
    maps, out_tokens = _maps(2)
    local = _locals(2, 7, torch.bfloat16)
    m = MLADCPKVGather(rank, "cpu", 1)
    assert m.init_kv_gather(12, TOKEN_DIM, SPLIT, torch.bfloat16)
    r = rank.rank
    m._planes.fill_(float("nan"))
    kv_c, k_pe = m.direct_kv_gather(local[r], torch.tensor(maps[r], dtype=torch.int32),
                                    out_tokens, 0)
    return {"kv_c": kv_c.clone(), "k_pe": k_pe.clone()}


def test_more_local_rows_than_the_share_take_the_fallback(tmp_path, monkeypatch):
    """Before: ZeroDivisionError on every rank (an empty call the gather module cannot
    take); now the rows move through the fallback, bit for bit."""
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_KV_GATHER", "1")
    found = run_ranks(2, _over_share_rank)
    want = _expected(2, torch.bfloat16)
    for r, f in enumerate(found):
        assert _same(f["kv_c"][:, 0], want[:, :SPLIT]), r
        assert _same(f["k_pe"][:, 0], want[:, SPLIT:]), r
