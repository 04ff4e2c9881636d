"""install() against the REAL modules of the released wheels (the pins:
tests/support/engine_wheels.py), and the engines' OWN plugin loaders picking up a plugin
entry point that calls it.

The wheels are not installed (their import chains need ~60 dependencies and CUDA
builds): the files below are extracted from the wheel zips and executed under their real
names; every other module they import is one of the named stubs. W = 2 on the ``local``
backend (two ranks as threads, Triton interpreter), every result against float64
(dcpc.engines.reference), NaN never passing.

Executed from the wheel as they ship:
- vLLM 0.33.0: vllm/v1/attention/ops/dcp.py (the defining module), vllm/plugins/__init__.py
  (load_general_plugins), vllm/envs.py, vllm/logger.py + vllm/logging_utils/*,
  vllm/v1/attention/ops/cp_common.py, vllm/triton_utils/{__init__,importing,
  tensor_descriptor}.py, vllm/utils/math_utils.py, vllm/model_executor/warmup/
  jit_warmup{,_triton_helper}.py (the launcher of vLLM's correct_attn_out kernel; on a
  host without an active GPU driver vLLM disables Triton, so vLLM's own
  cp_lse_ag_out_ar, the name dcpc keeps, runs here up to that kernel: see its test).
- SGLang 0.5.23: sglang/srt/layers/dcp/{__init__,comm,layout,metadata}.py,
  sglang/kernels/ops/attention/dcp_kernels.py, sglang/srt/plugins/{__init__,
  hook_registry}.py (load_plugins, HookRegistry.apply_hooks), sglang/srt/environ.py.

Stubs (each one's reason is also in WheelModules.stubs, checked below against this table):

- parent packages (vllm, vllm.v1, ..., sglang.srt, ...): nothing; an empty ``__path__``.
  Safe: their ``__init__`` imports the whole engine; an import nobody provided fails
  loudly.
- vllm.platforms: current_platform without an accelerator. Safe: platform detection
  needs CUDA/ROCm; the DCP code only asks is_cuda() (False on CPU, as on a CPU host).
- vllm.config: VllmConfig (a bare class), no current config. Safe: dcp.py uses
  VllmConfig as an annotation; the manager's config is a namespace with the fields vLLM
  reads.
- vllm.distributed, vllm.distributed.parallel_state: get_dcp_group() -> the test's
  Coordinator; in_the_same_node_as. Safe: GroupCoordinator needs NCCL and vLLM's
  initialisation; in_the_same_node_as is only reached by the CUDA symmetric-memory
  workspaces.
- vllm.v1.attention.backend: only max_decode_query_len, the wheel's source. Safe: the
  file imports vLLM's quantization and KV-cache layers; the function is executed as
  shipped.
- vllm.v1.worker.ubatching: only dbo_current_ubatch_id (+ its table), the wheel's
  source. Safe: the file imports forward_context; the function is executed as shipped.
- vllm.v1.attention.backends.flash_attn, vllm.v1.attention.backends.flashinfer,
  vllm.model_executor.layers.attention.mla_attention,
  vllm.model_executor.layers.attention.sparse_mla_attention,
  vllm.models.kimi_k3.nvidia.mla (every importer of dcp.py's names in the wheel): only
  their ``from vllm.v1.attention.ops.dcp import`` statement, the wheel's. Safe: they are
  the engine's model and kernel code; their bindings to dcp.py are exactly these
  statements.
- sglang.srt.distributed.parallel_state: GroupCoordinator (the Coordinator class),
  get_dcp_group. Safe: as vLLM's.
- sglang.srt.distributed.device_communicators.pynccl_allocator: use_symmetric_memory: a
  null context. Safe: NCCL's allocator; only SGLang's own cp_lse_ag_out_rs_mla (replaced
  by dcpc's, not called here) enters it.
- sglang.srt.runtime_context: get_parallel() raising. Safe: read by layout.py's
  KV-length helpers, which no test calls.
- sglang.srt.utils, sglang.srt.utils.common: is_hip() False, is_fi_a2a_supported()
  False. Safe: the package imports the server; CPU is neither ROCm nor FlashInfer.
- sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla: only its
  ``from sglang.srt.layers.dcp import`` statement. Safe: the DeepSeek model; its
  bindings are exactly this statement.
- sglang.srt.model_executor.model_runner (ModelRunner with only forward()) and
  sglang.srt.layers.radix_attention (RadixAttention with only layer_id and forward()):
  the targets of dcpc's call-id BEFORE hooks. Safe: SGLang's real HookRegistry puts the
  hooks over them; the hooks read nothing but ``layer_id`` (the real modules import the
  server and the CUDA attention backends).

The group handed to the engines' code is ``Coordinator`` (tests/support/engine_wheels.py): a
GroupCoordinator's attributes and collectives over the LocalGroup's threads (dcpc's torch
fallback exchange), where vLLM/SGLang run NCCL.
"""

from __future__ import annotations

import functools
import sys
import textwrap
import traceback
import types
from typing import Any

import pytest
import torch
from support import engine_wheels as EW

from dcpc.engines import reference as ref
from dcpc.engines import vllm as V
from dcpc.engines import vllm_free as F
from dcpc.runtime.local import LocalGroup

W, T, H, D, DQ, KV = 2, 4, 4, 16, 24, 8  # H heads in all, H // W per rank; KV: rows


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-2) -> None:
    """bf16 tolerance; -inf exactly where wanted; NaN never passes."""
    got, want = got.detach().double(), want.double()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not torch.isnan(got).any(), "NaN in the result"
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite], want[~finite]), "infinities differ"
    assert torch.allclose(got[finite], want[finite], atol=tol, rtol=tol), \
        (got - want).abs()[finite].max()


def _inputs(seed: int) -> dict[str, Any]:
    """Every rank's partials of all heads, with an empty shard (request 0 lives on rank 0
    only) and a CUDA-graph padding row (row 3), both holding NaN garbage."""
    g = torch.Generator().manual_seed(seed)
    full = [1, 4]
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    lens = [torch.tensor([s // W + (1 if s % W > r else 0) for s in full], dtype=torch.int32)
            for r in range(W)]
    outs, lses = [], []
    for r in range(W):
        o, lse = torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g) * 2
        for row in range(T):
            if row >= 3 or (row == 0 and lens[r][0] == 0):
                o[row], lse[row] = float("nan"), float("nan")
        outs.append(o.bfloat16())
        lses.append(lse)
    q = [torch.randn(T, H // W, DQ, generator=g).bfloat16() for _ in range(W)]
    return {"outs": outs, "lses": lses, "lens": lens, "qsl": qsl, "q": q}


@pytest.fixture
def dcpc_state(monkeypatch):
    """dcpc's adapter state that install() changes, restored after the test."""
    for var in ("DCPC_MAX_NUM_TOKENS", "VLLM_USE_DIRECT_DCP_A2A", "DCPC_VLLM_AG_RS",
                "VLLM_USE_DIRECT_DCP_Q_GATHER", "VLLM_USE_DIRECT_DCP_KV_GATHER", "DCPC_SGLANG",
                "DCPC_BACKEND", "VLLM_PLUGINS", "SGLANG_PLUGINS", "SGLANG_PLATFORM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(F, "_originals", {})
    monkeypatch.setattr(F, "_installed_tokens", [])
    V.forget_config()
    yield
    V.forget_config()


@pytest.fixture(params=EW.PINS["vllm"])
def real_vllm(request, dcpc_state):
    """Every pinned vLLM release's modules (0.33.0, 0.34.0), one per test run."""
    mods = EW.load_vllm(request.param)
    mods.version = request.param
    try:
        yield mods
    finally:
        mods.close()


@pytest.fixture
def real_sglang(dcpc_state):
    mods = EW.load_sglang()
    try:
        yield mods
    finally:
        mods.close()


def _plugin_dist(tmp_path, group: str, body: str) -> None:
    """A plugin distribution as pip installs one (a dist-info with entry_points.txt and its
    module), in a folder on sys.path."""
    info = tmp_path / "dcpc_wheel_plugin-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dcpc-wheel-plugin\n"
                                   "Version: 0.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\ndcpc = dcpc_wheel_plugin:register\n")
    (tmp_path / "dcpc_wheel_plugin.py").write_text(textwrap.dedent(body))


def test_the_stub_table_names_every_stub():
    """Every module the loaders stub or cut down is named in this module's table, and
    none of them is one of the files executed from the wheel."""
    doc = " ".join((__doc__ or "").split())
    for load, real in ((EW.load_vllm, EW.VLLM_REAL), (EW.load_sglang, EW.SGLANG_REAL)):
        mods = load()
        try:
            assert mods.stubs
            for name in mods.stubs:
                assert name in doc, name
            assert not set(mods.stubs) & set(real)
        finally:
            mods.close()


def test_a_wheel_that_cannot_be_fetched_fails_naming_the_command(tmp_path, monkeypatch):
    """No wheel in the cache and no index (no network): the test fails with the command
    to run; only DCPC_SKIP_ENGINE_WHEELS=1 turns that into a skip, with the same reason
    (the second time pip's failed run is replayed: one real pip run, ~2.5 s)."""
    import subprocess

    monkeypatch.setenv("DCPC_WHEEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what pip sees without network: no index
    monkeypatch.delenv(EW.SKIP_ENV, raising=False)
    runs, real_run = [], subprocess.run

    def run(*args, **kwargs):
        runs.append(real_run(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(EW.subprocess, "run", run)
    messages = []
    for skip, outcome in (("", pytest.fail.Exception), ("1", pytest.skip.Exception)):
        monkeypatch.setenv(EW.SKIP_ENV, skip)
        with pytest.raises(outcome) as caught:
            EW.wheel("sglang")
        messages.append(str(caught.value))
        monkeypatch.setattr(EW.subprocess, "run", lambda *a, **k: runs[0])
    assert runs[0].returncode != 0
    for msg in messages:
        assert (f"pip download --no-deps sglang=={EW.PINS['sglang'][-1]} -d "
                f"{tmp_path / 'cache'}"
                in msg), msg
        assert "could not be downloaded" in msg and EW.SKIP_ENV in msg
    assert messages[1].startswith(f"{EW.SKIP_ENV}=1: ")


# ---- vLLM (every pin) ---------------------------------------------------------------------
def test_vllm_loader_picks_up_the_plugin_and_install_rebinds_the_real_names(
        real_vllm, tmp_path, monkeypatch, caplog):
    """vLLM's own load_general_plugins (the wheel's) finds the entry point of group
    vllm.general_plugins, calls its register(), which calls install(): every binding of
    the replaced names, in dcp.py and in each module importing them by name, is dcpc's
    (dcpc holds each piece's contract: no warning); vLLM's own functions are kept as
    the fallbacks; cp_lse_ag_out_ar stays vLLM's."""
    ops = sys.modules[EW.VLLM_DCP]
    names = ["cp_lse_ag_out_rs", "dcp_a2a_lse_reduce", "MLADCPManager", "cp_lse_ag_out_ar"]
    if "dcp_a2a_v_up_proj_lse_reduce" in vars(ops):  # 0.34.0
        names.append("dcp_a2a_v_up_proj_lse_reduce")
    theirs = {n: vars(ops)[n] for n in names}
    _plugin_dist(tmp_path, "vllm.general_plugins", """
        CALLS = []

        def register():
            from dcpc.engines import vllm
            CALLS.append(vllm.install())
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "dcpc_wheel_plugin", None)  # restored after the test
    del sys.modules["dcpc_wheel_plugin"]
    plugins = sys.modules["vllm.plugins"]
    assert plugins.__file__.endswith("vllm/plugins/__init__.py")
    with caplog.at_level("INFO", logger="dcpc.engines"):
        plugins.load_general_plugins()
    calls = sys.modules["dcpc_wheel_plugin"].CALLS
    assert len(calls) == 1, "vLLM's loader did not run the plugin"
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "stays" in m], said  # every contract held
    assert any("vLLM's released layout (vllm.v1.attention.ops.dcp" in m for m in said), said
    for name in names[:2] + names[4:]:
        assert vars(ops)[name] is getattr(V, name)
    for name in ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce"):
        for importer in ("vllm.v1.attention.backends.flash_attn",
                         "vllm.v1.attention.backends.flashinfer"):
            assert vars(sys.modules[importer])[name] is getattr(V, name)
            assert f"{importer}.{name}" in calls[0]
    for importer in EW.VLLM_IMPORTERS[2:]:
        assert vars(sys.modules[importer])["MLADCPManager"] is V.MLADCPManager
    assert vars(ops)["cp_lse_ag_out_ar"] is theirs["cp_lse_ag_out_ar"]
    assert vars(sys.modules["vllm.v1.attention.backends.flashinfer"])[
        "mask_dcp_empty_shards_"] is ops.mask_dcp_empty_shards_  # not ours: untouched
    assert F._originals == theirs  # the wheel's own, for the fallbacks
    plugins.load_general_plugins()  # vLLM's once-per-process guard
    assert len(calls) == 1


def test_vllm_one_call_through_each_rebound_name(real_vllm):
    """After install(): one call through each rebound name, through the modules that
    hold them (a backend's import of the free functions, the MLA layer's import of the
    manager), every rank against float64; the kept cp_lse_ag_out_ar calls vLLM's own
    function from the wheel."""
    V.install()
    fa = sys.modules["vllm.v1.attention.backends.flash_attn"]
    fi = sys.modules["vllm.v1.attention.backends.flashinfer"]
    mla = sys.modules["vllm.model_executor.layers.attention.mla_attention"]
    x = _inputs(1)
    want = ref.vllm_combine(x["outs"], x["lses"], local_lens=x["lens"], qsl=x["qsl"])
    kv = [torch.randn(3, 40, generator=torch.Generator().manual_seed(7 + r)).bfloat16()
          for r in range(W)]
    ar_lses = [ref.source_mask(lse, n, x["qsl"]) for lse, n in zip(x["lses"], x["lens"],
                                                                strict=True)]
    config = types.SimpleNamespace(  # the fields of VllmConfig that vLLM's code reads
        parallel_config=types.SimpleNamespace(num_ubatches=1, dcp_comm_backend="a2a",
                                              decode_context_parallel_size=W),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=64, max_num_seqs=4),
        speculative_config=types.SimpleNamespace(  # 0.34.0's formula reads the last
            num_speculative_tokens=3, parallel_drafting=False,
            max_num_new_slots_for_drafting=0),
        num_speculative_tokens=3, use_v2_model_runner=False,
        compilation_config=types.SimpleNamespace(max_cudagraph_capture_size=8),
        kernel_config=types.SimpleNamespace(enable_jit_warmup=False))

    def rank_main(rank):
        r = rank.rank
        group = EW.set_group(rank)
        kw = {"seq_lens": x["lens"][r], "query_start_loc": x["qsl"]}
        lse_in = x["lses"][r].clone()
        try:  # the kept name: vLLM's own function, from the wheel
            V.cp_lse_ag_out_ar(x["outs"][r].clone(), lse_in, group, return_lse=True, **kw)
            ar: Any = "returned"
        except Exception as err:  # noqa: BLE001 - where vLLM's own function stopped
            ar = [(f.filename, f.name) for f in traceback.extract_tb(err.__traceback__)]
        gathers = group.gathers
        got = {"a2a": fa.dcp_a2a_lse_reduce(x["outs"][r], x["lses"][r], group,
                                            return_lse=True, **kw),
               "ag_rs": fi.cp_lse_ag_out_rs(x["outs"][r].clone(), x["lses"][r].clone(), group,
                                            return_lse=True, **kw),
               }
        m = mla.MLADCPManager(config, torch.device("cpu"), H // W, DQ, D, torch.bfloat16,
                              torch.bfloat16, None, True, False)
        got["manager"] = (type(m).__module__, m.max_num_tokens)
        got["q"] = m.query_gather(x["q"][r])
        got["combine"] = m.combine(x["outs"][r], x["lses"][r], **kw)
        m.init_kv_gather(torch.empty(KV + KV // W, 40, dtype=torch.bfloat16), KV)  # 0.33.0's
        got["kv"] = torch.full((W * 3, 40), float("nan"), dtype=torch.bfloat16)
        m.kv_gather(got["kv"], kv[r])  # as vLLM's chunked-context prefill calls it
        got = {k: v if isinstance(v, tuple) and isinstance(v[0], str) else
               tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone()
               for k, v in got.items()}
        return {**got, "ar": ar, "ar lse": lse_in, "ar gathers": gathers}

    results = LocalGroup(W, "cpu").run(rank_main)
    heads = H // W
    for r, got in enumerate(results):
        for path in ("a2a", "ag_rs"):
            _close(got[path][0], want[r][0])
            _close(got[path][1], want[r][1], tol=1e-4)
        # The kept cp_lse_ag_out_ar ran vLLM's own function: its mask_dcp_empty_shards_
        # masked the caller's LSE in place, it all-gathered the LSEs through the group,
        # then stopped at its Triton kernel, which vLLM disables on a host without an
        # active GPU driver (vllm/triton_utils/importing.py: HAS_TRITON False, the
        # kernel is a TritonPlaceholder function), as it would in a vLLM on this machine.
        assert isinstance(got["ar"], list), "vLLM's own cp_lse_ag_out_ar returned on CPU"
        ours = [i for i, (f, n) in enumerate(got["ar"]) if n == "cp_lse_ag_out_ar"]
        assert got["ar"][ours[0]][0].endswith("/dcpc/engines/vllm_free.py")
        assert got["ar"][ours[1]][0].endswith("vllm/v1/attention/ops/dcp.py")
        assert ("correct_attn_out" in [n for _, n in got["ar"][ours[1]:]])
        _close(got["ar lse"], ar_lses[r].float(), tol=0)
        assert got["ar gathers"] == 1
        # vLLM's own formula (the wheel's): min(64, max(4 seqs * (1 + 3), 8))
        assert got["manager"] == ("dcpc.engines.vllm_manager", 16)
        _close(got["q"], ref.gather_heads(x["q"]), tol=0)
        _close(got["combine"], want[r][0])
        _close(got["kv"], ref.gather_rows(kv), tol=0)
        assert got["a2a"][0].shape == (T, heads, D)


def _partials(world: int, tokens: int, dim: int, seed: int) -> dict[str, Any]:
    """Every rank's partials [B, H, dim] of all heads with an empty shard (request 0 on
    rank 0 only) whose rows hold NaN garbage, one request per token."""
    g = torch.Generator().manual_seed(seed)
    heads = 2 * world
    full = [1] + [3 + i for i in range(tokens - 1)]
    lens = [torch.tensor([(n - r + world - 1) // world for n in full], dtype=torch.int32)
            for r in range(world)]
    outs, lses = [], []
    for r in range(world):
        o, lse = torch.randn(tokens, heads, dim, generator=g), torch.randn(tokens, heads,
                                                                         generator=g) * 2
        o[lens[r] == 0], lse[lens[r] == 0] = float("nan"), float("nan")
        outs.append(o.bfloat16())
        lses.append(lse)
    w_uv = (torch.randn(heads, dim, 8, generator=g) * 0.3).bfloat16()
    return {"outs": outs, "lses": lses, "lens": lens, "w_uv": w_uv,
            "qsl": torch.arange(tokens + 1, dtype=torch.int32)}


@pytest.mark.parametrize("world", [2, 3])
def test_vllm_out_and_the_w_uv_fused_merge(real_vllm, world):
    """vLLM 0.34.0's dcp_a2a_lse_reduce(..., out=) through a backend's binding (the
    merge written into the caller's buffer, which is returned; before: RuntimeError
    "Boolean value of Tensor with more than one value is ambiguous"), and the W_UV-fused
    merge: vLLM's own dcp_a2a_v_up_proj_lse_reduce (the wheel's, 0.34.0: it calls the
    rebound dcp_a2a_lse_reduce, with out= from 8 tokens up) and dcpc's, at 4 and 9
    tokens, every rank against float64."""
    V.install()
    fa = sys.modules["vllm.v1.attention.backends.flash_attn"]
    theirs = F._originals.get("dcp_a2a_v_up_proj_lse_reduce")
    assert (theirs is not None) == (real_vllm.version != "0.33.0")
    cases = {b: _partials(world, b, 16, 40 + b) for b in (4, 9)}

    def rank_main(rank):
        r, group = rank.rank, EW.set_group(rank)
        got = {}
        for b, x in cases.items():
            kw = {"seq_lens": x["lens"][r], "query_start_loc": x["qsl"]}
            buf = torch.full((b, 2, 16), float("nan"), dtype=torch.bfloat16)
            res = fa.dcp_a2a_lse_reduce(x["outs"][r], x["lses"][r], group, out=buf,
                                        return_lse=True, **kw)
            got[(b, "out")] = (res[0] is buf, buf.clone(), res[1].clone())
            for name, fn in (("dcpc", V.dcp_a2a_v_up_proj_lse_reduce), ("vllm", theirs)):
                if fn is None:
                    continue
                into = torch.full((b, 2 * 8), float("nan"), dtype=torch.bfloat16)
                assert fn(x["outs"][r], x["lses"][r], x["w_uv"], into, group, **kw) is None
                got[(b, name)] = into
        return got

    for r, got in enumerate(LocalGroup(world, "cpu").run(rank_main)):
        for b, x in cases.items():
            want = ref.vllm_combine(x["outs"], x["lses"], local_lens=x["lens"], qsl=x["qsl"])
            same, buf, lse = got[(b, "out")]
            assert same, "dcp_a2a_lse_reduce(out=) must return the caller's buffer"
            _close(buf, want[r][0])
            _close(lse, want[r][1], tol=1e-4)
            fused = ref.vllm_v_up_proj_combine(x["outs"], x["lses"], x["w_uv"],
                                               local_lens=x["lens"], qsl=x["qsl"])[r]
            for name in ("dcpc", "vllm"):
                if (b, name) in got:
                    _close(got[(b, name)], fused, tol=3e-2)


# ---- the contract: what vLLM's source uses, and what dcpc provides ------------------------
@functools.cache
def _uses(version: str) -> tuple:
    """Every use of the manager and of the replaced names in the whole vLLM wheel."""
    from dcpc.engines.contract import scan, source_files
    from dcpc.engines.vllm_pieces import replacements

    return tuple(scan(source_files(EW.wheel("vllm", version)), replacements()))


@pytest.mark.parametrize("version", EW.PINS["vllm"])
def test_dcpc_provides_everything_vllms_source_uses(version, dcpc_state):
    """Derived from the wheel's source, all of it: every attribute read off a DCP manager
    object (``x.dcp_manager.NAME``), every call of the manager's attributes and of the
    replaced functions and class (each keyword, the number of positional arguments,
    ``functools.partial`` and aliases such as FlashAttention's ``self.dcp_combine``):
    dcpc's manager and functions take all of it (on 0.34.0 before: the manager lacked
    v_up_proj_combine and direct_query_gather_max_tokens, dcp_a2a_lse_reduce took out=
    only into **kwargs). And every attribute vLLM reads is one vLLM's own class has (the
    premise of install()'s class check)."""
    from dcpc.engines import contract
    from dcpc.engines.vllm_pieces import replacements

    uses = _uses(version)
    read = {u.name for u in uses if u.on_manager}
    called = {u.name for u in uses if not u.on_manager}
    assert {"combine", "query_gather", "init_kv_gather", "kv_gather", "group"} <= read
    assert {"MLADCPManager", "cp_lse_ag_out_rs", "dcp_a2a_lse_reduce"} <= called
    if version != "0.33.0":
        assert {"v_up_proj_combine", "direct_query_gather_max_tokens"} <= read
        assert any(u.name == "dcp_a2a_lse_reduce" and "out" in u.keywords for u in uses)
    assert contract.check_uses(uses, V.MLADCPManager, replacements(), F.ENGINE_ONLY) == []
    mods = EW.load_vllm(version)
    try:  # vLLM's class has every attribute its callers read
        theirs = contract.class_surface(sys.modules[EW.VLLM_DCP].MLADCPManager)
        assert read <= theirs.names(), read - theirs.names()
    finally:
        mods.close()


def test_the_contract_test_fails_when_dcpc_lacks_one_name(monkeypatch):
    """The check above, with one thing removed from dcpc: an attribute of the manager
    (direct_query_gather_max_tokens) and a keyword (dcp_a2a_lse_reduce's out): each is
    named with the line of vLLM's source that uses it."""
    from dcpc.engines import contract
    from dcpc.engines.vllm_pieces import replacements

    uses = _uses(EW.PINS["vllm"][-1])
    real = contract.class_surface

    def lacking(cls):
        found = real(cls)
        found.attributes.discard("direct_query_gather_max_tokens")
        return found

    monkeypatch.setattr(contract, "class_surface", lacking)
    missing = contract.check_uses(uses, V.MLADCPManager, replacements(), F.ENGINE_ONLY)
    assert missing == ["vllm/model_executor/layers/attention/mla_attention.py:1287: "
                       "attribute 'direct_query_gather_max_tokens' of the manager: not "
                       "dcpc's"], missing
    monkeypatch.setattr(contract, "class_surface", real)

    def no_out(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False,
               is_lse_base_on_e=True, seq_lens=None, query_start_loc=None, **engine_kwargs):
        raise AssertionError("not called")

    functions = {**replacements(), "dcp_a2a_lse_reduce": no_out}
    missing = contract.check_uses(uses, V.MLADCPManager, functions, F.ENGINE_ONLY)
    assert missing == ["vllm/v1/attention/ops/dcp.py:1074: dcp_a2a_lse_reduce(...): "
                       "keyword 'out' is not a parameter of dcpc's"], missing


@pytest.mark.parametrize("version", EW.PINS["vllm"])
def test_install_checks_the_real_classes_and_functions(version, dcpc_state):
    """install()'s contract check, on the wheel's own MLADCPManager and free functions:
    dcpc's hold every one (nothing kept as vLLM's), and a class of vLLM's with one more
    public attribute would be kept, named."""
    from dcpc.engines.vllm_install import contract as check

    mods = EW.load_vllm(version)
    try:
        ops = sys.modules[EW.VLLM_DCP]
        assert check("MLADCPManager", ops.MLADCPManager) == (V.MLADCPManager, [])
        for name in ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce",
                     "dcp_a2a_v_up_proj_lse_reduce"):
            if name in vars(ops):
                assert check(name, vars(ops)[name]) == (getattr(V, name), []), name

        class Later(ops.MLADCPManager):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.fused_o_proj = None

        mine, why = check("MLADCPManager", Later)
        assert mine is None and why == ["MLADCPManager.fused_o_proj: vLLM's attribute, not "
                                        "dcpc's"], why
    finally:
        mods.close()


# ---- SGLang 0.5.23 ------------------------------------------------------------------------
def test_sglang_loader_picks_up_the_plugin_and_one_call_through_each_rebound_name(
        real_sglang, tmp_path, monkeypatch):
    """SGLang's own load_plugins (the wheel's) finds the entry point of group
    sglang.srt.plugins and runs it; dcpc's install() registers REPLACE hooks, which
    SGLang's HookRegistry.apply_hooks puts over comm.py's names and every ``from ...
    import`` of them (the dcp package, the DeepSeek MLA forward), once: one wrapper of
    SGLang's, calling dcpc's function. Then one call through each rebound name as the
    MLA forward holds it, every rank against float64; SGLang's own cp_lse_ag_out_rs_mha
    (not replaced) still runs as SGLang's."""
    from dcpc.engines import sglang as S

    comm = sys.modules[EW.SGLANG_COMM]
    theirs = {n: vars(comm)[n] for n in S.PATCHED}
    _plugin_dist(tmp_path, "sglang.srt.plugins", """
        CALLS = []

        def register():
            from dcpc.engines import sglang
            CALLS.append(sglang.install())
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "dcpc_wheel_plugin", None)
    del sys.modules["dcpc_wheel_plugin"]
    plugins = sys.modules["sglang.srt.plugins"]
    assert plugins.__file__.endswith("sglang/srt/plugins/__init__.py")
    plugins.load_plugins()
    calls = sys.modules["dcpc_wheel_plugin"].CALLS
    # the hooks' path: the replaced names, then the call ids' BEFORE hooks
    assert calls == [[*(f"{EW.SGLANG_COMM}.{n}" for n in S.PATCHED), *S.CALL_HOOKS]], calls
    from dcpc.engines.call_ids import current_call_id, reset_calls

    runner = sys.modules["sglang.srt.model_executor.model_runner"].ModelRunner()
    attention = sys.modules["sglang.srt.layers.radix_attention"].RadixAttention
    reset_calls()
    try:  # SGLang's registry put dcpc's hooks before both methods: ids follow them
        assert runner.forward() == "forward" and attention(3).forward() == 3
        first = current_call_id()
        assert runner.forward() == "forward" and attention(3).forward() == 3
        assert first is not None and current_call_id() is not None
        assert current_call_id() != first  # the next forward's layer 3
        assert attention(4).forward() == 4 and current_call_id() == first + 1 + 101
    finally:
        reset_calls()
    fwd = sys.modules[EW.SGLANG_IMPORTERS[0]]
    for name in S.PATCHED:
        for holder in (comm, sys.modules["sglang.srt.layers.dcp"], fwd):
            bound = vars(holder)[name]
            assert bound is vars(comm)[name], (holder.__name__, name)
        bound = vars(comm)[name]
        assert bound.__wrapped__ is theirs[name]  # one wrapper, over SGLang's own
        assert [c.cell_contents for c in bound.__closure__] == [getattr(S, name)]
    assert fwd.__dict__.get("cp_lse_ag_out_rs_mha") is None  # not imported by the forward
    keep = sys.modules["sglang.srt.layers.dcp"].cp_lse_ag_out_rs_mha
    assert keep.__module__ == EW.SGLANG_COMM and not hasattr(keep, "__wrapped__")

    x = _inputs(2)
    clean = [torch.randn_like(o, dtype=torch.float32).bfloat16() for o in x["outs"]]
    lses = [torch.randn(T, H, generator=torch.Generator().manual_seed(5 + r)) * 2
            for r in range(W)]
    nope = [torch.randn(T, H // W, 32).bfloat16() for _ in range(W)]

    def rank_main(rank):
        r = rank.rank
        group = EW.set_group(rank)
        got = {"a2a": fwd.dcp_a2a_lse_reduce(clean[r], lses[r], group),
               "ag_rs": fwd.cp_lse_ag_out_rs_mla(clean[r], lses[r], group),
               "q": fwd.all_gather_q_for_mla_decode(nope[r], x["q"][r]),  # get_dcp_group()
               "mha": keep(clean[r].clone(), lses[r], group)}  # SGLang's own, in torch
        return {k: tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone()
                for k, v in got.items()}

    results = LocalGroup(W, "cpu").run(rank_main)
    for r, got in enumerate(results):
        _close(got["a2a"], ref.sglang_a2a(clean, lses)[r])
        _close(got["ag_rs"], ref.sglang_ag_rs_mla(clean, lses, base2=True)[r])
        _close(got["q"][0], ref.gather_heads(nope), tol=0)
        _close(got["q"][1], ref.gather_heads(x["q"]), tol=0)
        _close(got["mha"], ref.sglang_a2a(clean, lses)[r])  # natural-log LSE, as SGLang
    plugins.load_plugins()  # SGLang's once-per-process guard
    assert len(calls) == 1
