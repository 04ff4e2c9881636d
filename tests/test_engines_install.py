"""Installing the adapters over an engine's own functions, and the engine's own path as
the fallback. Neither vLLM nor SGLang runs here (they need CUDA builds), so their
modules are stand-ins with the names and signatures of vLLM 0.33.0 / SGLang 0.5.23
(docs/engines.md): what is tested is dcpc's side, the patching and the routing."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dcpc.engines import sglang as S
from dcpc.engines import vllm as V
from dcpc.engines.combine import check_mask_args
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.local import LocalGroup


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


@pytest.fixture
def fake_vllm(monkeypatch):
    """vllm.v1.attention.ops.dcp with vLLM's three names, a backend that imported two of
    them by name, and vllm.config without a current config."""
    calls: list[tuple] = []

    def cp_lse_ag_out_rs(*args, **kwargs):
        calls.append(("cp_lse_ag_out_rs", args, kwargs))
        return "vllm ag_rs"

    def dcp_a2a_lse_reduce(*args, **kwargs):
        calls.append(("dcp_a2a_lse_reduce", args, kwargs))
        return "vllm a2a"

    def cp_lse_ag_out_ar(*args, **kwargs):
        calls.append(("cp_lse_ag_out_ar", args, kwargs))
        return "vllm ar"

    class MLADCPManager:
        pass

    ops = _module("vllm.v1.attention.ops.dcp", cp_lse_ag_out_rs=cp_lse_ag_out_rs,
                  dcp_a2a_lse_reduce=dcp_a2a_lse_reduce, MLADCPManager=MLADCPManager,
                  cp_lse_ag_out_ar=cp_lse_ag_out_ar)
    backend = _module("vllm.v1.attention.backends.flash_attn",
                      cp_lse_ag_out_rs=cp_lse_ag_out_rs, dcp_a2a_lse_reduce=dcp_a2a_lse_reduce)
    config = _module("vllm.config", get_current_vllm_config_or_none=lambda: None)
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    monkeypatch.setitem(sys.modules, ops.__name__, ops)
    monkeypatch.setitem(sys.modules, backend.__name__, backend)
    monkeypatch.setitem(sys.modules, config.__name__, config)
    monkeypatch.setattr(sys.modules["vllm.v1.attention"], "ops", sys.modules[
        "vllm.v1.attention.ops"], raising=False)
    monkeypatch.setattr(sys.modules["vllm.v1.attention.ops"], "dcp", ops, raising=False)
    monkeypatch.setattr(V, "_originals", {})
    return types.SimpleNamespace(ops=ops, backend=backend, calls=calls,
                                 originals=(cp_lse_ag_out_rs, dcp_a2a_lse_reduce, MLADCPManager,
                                            cp_lse_ag_out_ar))


def test_install_patches_every_binding_and_keeps_vllms_own(fake_vllm):
    patched = V.install()
    for module in (fake_vllm.ops, fake_vllm.backend):
        assert module.cp_lse_ag_out_rs is V.cp_lse_ag_out_rs
        assert module.dcp_a2a_lse_reduce is V.dcp_a2a_lse_reduce
    assert fake_vllm.ops.MLADCPManager is V.MLADCPManager
    assert "vllm.v1.attention.backends.flash_attn.cp_lse_ag_out_rs" in patched
    assert V._originals["cp_lse_ag_out_rs"] is fake_vllm.originals[0]
    assert V.install() == []  # idempotent: nothing left to patch
    assert V._originals["MLADCPManager"] is fake_vllm.originals[2]


def test_a_switch_at_0_takes_vllms_own_function_with_the_callers_arguments(fake_vllm,
                                                                           monkeypatch):
    """VLLM_USE_DIRECT_DCP_A2A=0 (and any call dcpc does not take) goes to vLLM's saved
    function, unchanged arguments, its result returned as is: no dcpc module is built."""
    V.install()
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_A2A", "0")
    monkeypatch.setenv("DCPC_VLLM_AG_RS", "0")
    out = torch.randn(3, 4, 8).bfloat16()
    lse = torch.randn(3, 4)
    lens, qsl = torch.tensor([2, 1], dtype=torch.int32), torch.tensor([0, 2, 3],
                                                                        dtype=torch.int32)

    def rank_main(rank):
        a2a = V.dcp_a2a_lse_reduce(out, lse, rank, None, True, True, lens, qsl)
        ag_rs = V.cp_lse_ag_out_rs(out, lse, rank, return_lse=False, seq_lens=lens,
                                   query_start_loc=qsl)
        return a2a, ag_rs

    results = LocalGroup(2, "cpu").run(rank_main)
    assert results == [("vllm a2a", "vllm ag_rs")] * 2
    names = [c[0] for c in fake_vllm.calls]
    assert sorted(names) == ["cp_lse_ag_out_rs"] * 2 + ["dcp_a2a_lse_reduce"] * 2
    first = next(c for c in fake_vllm.calls if c[0] == "dcp_a2a_lse_reduce")
    assert first[1][0] is out and first[1][1] is lse and first[1][6] is lens  # unmasked


def test_an_install_over_an_earlier_hand_patch_never_keeps_dcpc_as_vllms_own(fake_vllm,
                                                                             monkeypatch):
    """The old docs' loop patched the names first: install() must not save dcpc's own
    function as the fallback (every fallback call would recurse)."""
    fake_vllm.ops.dcp_a2a_lse_reduce = V.dcp_a2a_lse_reduce
    V.install()
    assert "dcp_a2a_lse_reduce" not in V._originals
    assert V._engine_fallback("dcp_a2a_lse_reduce") is None
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_A2A", "0")
    out, lse = torch.randn(3, 4, 8).bfloat16(), torch.randn(3, 4)
    got = LocalGroup(2, "cpu").run(lambda rank: V.dcp_a2a_lse_reduce(out, lse, rank))
    assert all(isinstance(g, torch.Tensor) and g.shape == (3, 2, 8) for g in got)  # torch


def test_pcp_all_reduce_is_vllms_own_once_installed(fake_vllm):
    V.install()
    assert fake_vllm.ops.cp_lse_ag_out_ar is fake_vllm.originals[3]  # kept, not replaced
    out, lse = torch.randn(3, 4, 8).bfloat16(), torch.randn(3, 4)
    assert V.cp_lse_ag_out_ar(out, lse, "group") == "vllm ar"
    assert fake_vllm.calls[-1][1][:3] == (out, lse, "group")


def test_install_sets_the_free_functions_workspace(fake_vllm, monkeypatch):
    monkeypatch.delenv("DCPC_MAX_NUM_TOKENS", raising=False)
    monkeypatch.setattr(V, "_installed_tokens", [])
    try:
        V.install(max_num_tokens=1024)
        assert V._free_tokens() == 1024
    finally:
        V._free_tokens.cache_clear()


def test_without_a_current_vllm_config_the_workspace_is_the_default(fake_vllm, monkeypatch):
    monkeypatch.delenv("DCPC_MAX_NUM_TOKENS", raising=False)
    monkeypatch.setattr(V, "_installed_tokens", [])
    V._free_tokens.cache_clear()
    try:
        assert V._free_tokens() == V.DEFAULT_MAX_NUM_TOKENS
    finally:
        V._free_tokens.cache_clear()


@pytest.mark.parametrize("lens, qsl, what", [
    (torch.tensor([[1, 2]]), torch.tensor([0, 1, 2]), "1-D"),
    (torch.tensor([1, 2]), torch.tensor([0, 1]), "len(seq_lens) + 1"),
])
def test_mask_arguments_are_checked_as_vllm_does(lens, qsl, what):
    with pytest.raises(DcpcArgumentError, match=what.replace("(", r"\(").replace(")", r"\)")
                       .replace("+", r"\+")):
        check_mask_args(lens, qsl)


def test_sglang_install_patches_by_hand_without_a_hook_registry(monkeypatch):
    def dcp_a2a_lse_reduce(*a, **k):
        return "sglang"

    names = {n: dcp_a2a_lse_reduce for n in S.PATCHED}
    comm = _module("sglang.srt.layers.dcp.comm", **names)
    user = _module("sglang.srt.models.forward_mla", **names)  # `from ... import` bindings
    for name in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.dcp"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    monkeypatch.setattr(sys.modules["sglang.srt.layers.dcp"], "comm", comm, raising=False)
    monkeypatch.setitem(sys.modules, comm.__name__, comm)
    monkeypatch.setitem(sys.modules, user.__name__, user)
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins", None)  # no HookRegistry
    patched = S.install()
    for name in S.PATCHED:
        assert getattr(comm, name) is getattr(S, name)
        assert getattr(user, name) is getattr(S, name)
    assert len(patched) == 2 * len(S.PATCHED)


def test_sglang_install_registers_replace_hooks(monkeypatch):
    registered: list[tuple] = []

    class HookType:
        REPLACE = "replace"

    class HookRegistry:
        @classmethod
        def register(cls, target, hook, hook_type):
            registered.append((target, hook, hook_type))

    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    plugins = _module("sglang.srt.plugins", _plugins_loaded=False)
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins", plugins)
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", _module(
        "sglang.srt.plugins.hook_registry", HookRegistry=HookRegistry, HookType=HookType))
    assert S.install() == [f"sglang.srt.layers.dcp.comm.{n}" for n in S.PATCHED]
    assert registered == [(f"sglang.srt.layers.dcp.comm.{n}", getattr(S, n), "replace")
                          for n in S.PATCHED]
    # called after SGLang applied its hooks: assigned now as well
    def theirs(*a, **k):
        return "sglang"

    comm = _module("sglang.srt.layers.dcp.comm", **{n: theirs for n in S.PATCHED})
    for name in ("sglang.srt.layers", "sglang.srt.layers.dcp"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    monkeypatch.setattr(sys.modules["sglang.srt.layers.dcp"], "comm", comm, raising=False)
    monkeypatch.setitem(sys.modules, comm.__name__, comm)
    plugins._plugins_loaded = True
    done = S.install()
    assert all(getattr(comm, n) is getattr(S, n) for n in S.PATCHED)
    assert f"sglang.srt.layers.dcp.comm.{S.PATCHED[0]}" in done


def test_sglang_install_from_load_plugins_registers_hooks_only(monkeypatch):
    """SGLang's load_plugins() sets _plugins_loaded BEFORE it runs the plugins: install()
    called from there must only register its hooks (SGLang applies them next), not also
    assign, or SGLang's hook wraps dcpc's function a second time."""
    registered: list[tuple] = []

    class HookType:
        REPLACE = "replace"

    class HookRegistry:
        @classmethod
        def register(cls, target, hook, hook_type):
            registered.append((target, hook, hook_type))

    def theirs(*a, **k):
        return "sglang"

    comm = _module("sglang.srt.layers.dcp.comm", **{n: theirs for n in S.PATCHED})
    for name in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.dcp"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    monkeypatch.setattr(sys.modules["sglang.srt.layers.dcp"], "comm", comm, raising=False)
    monkeypatch.setitem(sys.modules, comm.__name__, comm)
    plugins = _module("sglang.srt.plugins", _plugins_loaded=False, install=S.install,
                      comm=comm, registered=registered)
    # SGLang's order: mark loaded, run the plugins, then apply the hooks (each REPLACE
    # hook wraps whatever the target holds at that time)
    exec(compile(
        "def load_plugins():\n"
        "    global _plugins_loaded\n"
        "    _plugins_loaded = True\n"
        "    install()\n"
        "    for target, hook, _ in registered:\n"
        "        name = target.rsplit('.', 1)[1]\n"
        "        held = getattr(comm, name)\n"
        "        def applied(*a, _hook=hook, _held=held, **k):\n"
        "            return _hook(*a, **k)\n"
        "        applied.wrapped, applied.replaced = hook, held\n"
        "        setattr(comm, name, applied)\n", "sglang/srt/plugins/__init__.py", "exec"),
        plugins.__dict__)
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins", plugins)
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", _module(
        "sglang.srt.plugins.hook_registry", HookRegistry=HookRegistry, HookType=HookType))
    plugins.load_plugins()
    assert [r[0] for r in registered] == [f"sglang.srt.layers.dcp.comm.{n}" for n in S.PATCHED]
    for name in S.PATCHED:
        applied = getattr(comm, name)
        assert applied.wrapped is getattr(S, name)
        assert applied.replaced is theirs, name  # SGLang's own, not dcpc's: one wrap


def test_install_takes_the_workspace_from_the_current_vllm_config(fake_vllm, monkeypatch,
                                                                  caplog):
    """A plugin's install() runs while vLLM's config is current: the free functions keep
    vLLM's workspace size for later calls (none is current in forward), and say so."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        speculative_config=None, num_speculative_tokens=0,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=96),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=512))
    current = [cfg]
    monkeypatch.setattr(sys.modules["vllm.config"], "get_current_vllm_config_or_none",
                        lambda: current[0])
    monkeypatch.delenv("DCPC_MAX_NUM_TOKENS", raising=False)
    monkeypatch.setattr(V, "_installed_tokens", [])
    V._free_tokens.cache_clear()
    try:
        with caplog.at_level("INFO", logger="dcpc.engines"):
            V.install()
        current[0] = None  # forward: no config is current
        assert V._free_tokens() == 512
        assert any("workspace is 512 tokens (vLLM's config" in r.getMessage()
                   for r in caplog.records), caplog.records
    finally:
        V._free_tokens.cache_clear()


def test_install_leaves_an_unknown_vllm_layout_alone_and_says_so_once(monkeypatch, caplog):
    """A layout neither 0.33.0's nor main's (a dcp_utils without main's free functions,
    then a dcp module with main's init_kv_gather but no direct_kv_gather; main's own
    layout is tests/test_engines_vllm_main.py): install() must not raise (it runs
    inside the engine's plugin loader), patch nothing, and log why once."""
    def dcp_a2a_lse_reduce(*a, **k):
        return "vllm a2a"

    class MLADCPManager:
        def init_kv_gather(self, max_gathered_tokens, token_dim, plane_split_dim, dtype):
            return False

    utils = _module("vllm.v1.attention.ops.dcp_utils", MLADCPManager=MLADCPManager,
                    dcp_a2a_lse_reduce=dcp_a2a_lse_reduce)
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.ops.dcp", None)  # import fails
    monkeypatch.setattr(V, "_originals", {})
    from dcpc.engines import common

    monkeypatch.setattr(common, "_logged", set())
    with caplog.at_level("WARNING", logger="dcpc.engines"):
        assert V.install() == [] and V.install() == []
    assert utils.dcp_a2a_lse_reduce is dcp_a2a_lse_reduce
    assert utils.MLADCPManager is MLADCPManager
    said = [r.getMessage() for r in caplog.records if "own DCP path stays" in r.getMessage()]
    assert len(said) == 1 and "vllm.v1.attention.ops.dcp does not import" in said[0], said
    # the released layout with the coming init_kv_gather: also left alone
    ops = _module("vllm.v1.attention.ops.dcp", MLADCPManager=MLADCPManager,
                  dcp_a2a_lse_reduce=dcp_a2a_lse_reduce, cp_lse_ag_out_rs=dcp_a2a_lse_reduce,
                  cp_lse_ag_out_ar=dcp_a2a_lse_reduce)
    monkeypatch.setitem(sys.modules, ops.__name__, ops)
    monkeypatch.setattr(sys.modules["vllm.v1.attention.ops"], "dcp", ops, raising=False)
    monkeypatch.setattr(common, "_logged", set())
    with caplog.at_level("WARNING", logger="dcpc.engines"):
        assert V.install() == []
    assert ops.dcp_a2a_lse_reduce is dcp_a2a_lse_reduce
    assert any("init_kv_gather(max_gathered_tokens, token_dim, plane_split_dim, dtype)"
               in r.getMessage() for r in caplog.records)
