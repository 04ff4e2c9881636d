"""Installing the adapters over an engine's own functions, and the engine's own path as
the fallback. Neither vLLM nor SGLang runs here (they need CUDA builds), so their
modules are stand-ins with the names and signatures of vLLM 0.33.0 / SGLang 0.5.23
(docs/engines.md): what is tested is dcpc's side, the patching and the routing."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch

from dcpc.engines import sglang as S
from dcpc.engines import vllm as V
from dcpc.engines import vllm_free as F
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
    monkeypatch.setattr(F, "_originals", {})
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
    assert F._originals["cp_lse_ag_out_rs"] is fake_vllm.originals[0]
    assert V.install() == []  # idempotent: nothing left to patch
    assert F._originals["MLADCPManager"] is fake_vllm.originals[2]


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
    assert "dcp_a2a_lse_reduce" not in F._originals
    assert F.engine_fallback("dcp_a2a_lse_reduce") is None
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
    monkeypatch.setattr(F, "_installed_tokens", [])
    try:
        V.install(max_num_tokens=1024)
        assert F._free_tokens() == 1024
    finally:
        F._free_tokens.cache_clear()


def test_without_a_current_vllm_config_the_workspace_is_the_default(fake_vllm, monkeypatch):
    monkeypatch.delenv("DCPC_MAX_NUM_TOKENS", raising=False)
    monkeypatch.setattr(F, "_installed_tokens", [])
    F._free_tokens.cache_clear()
    try:
        assert F._free_tokens() == F.DEFAULT_MAX_NUM_TOKENS
    finally:
        F._free_tokens.cache_clear()


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


def _config(max_num_seqs: int = 96, graphs: int | None = 512,
            sizes: list[int] | None = None):
    from types import SimpleNamespace

    return SimpleNamespace(
        speculative_config=None, num_speculative_tokens=0,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192,
                                         max_num_seqs=max_num_seqs),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=graphs,
                                           cudagraph_capture_sizes=sizes))


def test_the_workspace_comes_from_the_config_of_the_first_forward_not_install(
        fake_vllm, monkeypatch, caplog):
    """vLLM 0.34.0 loads general plugins with no config current (worker_base.py:
    load_general_plugins() before any set_current_vllm_config): install() fixes no
    workspace and says where it will come from; the first set_forward_context (the
    profile run's) carries vLLM's config, which the hooked function keeps: the free
    functions' first call, later, with no config current, takes its workspace and
    capture sizes from it. Before: install() logged a 256-token workspace and no
    capture sizes, and kept them."""
    import contextlib

    @contextlib.contextmanager
    def set_forward_context(attn_metadata, vllm_config, num_tokens=None):
        yield "context"

    fc = _module("vllm.forward_context", set_forward_context=set_forward_context)
    monkeypatch.setitem(sys.modules, fc.__name__, fc)
    monkeypatch.delenv("DCPC_MAX_NUM_TOKENS", raising=False)
    monkeypatch.delenv("DCPC_CAPTURE_SIZES", raising=False)
    monkeypatch.setattr(F, "_installed_tokens", [])
    with caplog.at_level("INFO", logger="dcpc.engines"):
        V.install()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "workspace comes from vLLM's config once one is seen" in said, said
    assert "workspace is" not in said and "capture sizes [" not in said, said
    with fc.set_forward_context(None, _config(sizes=[1, 2, 4, 512])) as ctx:  # the profile run
        assert ctx == "context"
    with caplog.at_level("INFO", logger="dcpc.engines"):
        assert F._free_tokens() == 512  # max(96 x 1, 512), no config current now
    assert any("workspace is 512 tokens (vLLM's config" in r.getMessage()
               for r in caplog.records), caplog.records
    assert F.capture_sizes() == ([1, 2, 4, 512],
                                 "vLLM's compilation_config.cudagraph_capture_sizes")
    with fc.set_forward_context(None, _config(max_num_seqs=4096)):  # the first one stays
        pass
    F._free_tokens.cache_clear()
    assert F._free_tokens() == 512


def test_overrides_and_the_manager_config(fake_vllm, monkeypatch):
    """DCPC_MAX_NUM_TOKENS and DCPC_CAPTURE_SIZES win over any config; the config an
    MLADCPManager is built with (load_model) is a config seen; a config current at the
    first call counts when none was seen; none at all: 256 and no sizes."""
    monkeypatch.delenv("DCPC_MAX_NUM_TOKENS", raising=False)
    monkeypatch.setattr(F, "_installed_tokens", [])
    assert F._free_tokens() == F.DEFAULT_MAX_NUM_TOKENS
    assert F.capture_sizes()[0] is None
    V.forget_config()
    current = [_config(max_num_seqs=8, graphs=None)]
    monkeypatch.setattr(sys.modules["vllm.config"], "get_current_vllm_config_or_none",
                        lambda: current[0])
    assert F._free_tokens() == 8  # current at the first call
    current[0] = None
    F._free_tokens.cache_clear()
    assert F._free_tokens() == 8  # kept: seen
    V.forget_config()
    V.note_config(_config(max_num_seqs=3, graphs=None, sizes=[2, 3]))  # the manager's
    monkeypatch.setenv("DCPC_CAPTURE_SIZES", "1,5")
    assert F._free_tokens() == 3
    assert F.capture_sizes() == ([1, 5], "DCPC_CAPTURE_SIZES")
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", "40")
    F._free_tokens.cache_clear()
    assert F._free_tokens() == 40


def test_install_keeps_vllms_piece_whose_contract_dcpc_does_not_hold(fake_vllm, caplog,
                                                                     monkeypatch):
    """The contract check, per piece: a dcp_a2a_lse_reduce with a parameter dcpc does
    not take (a future ``scale=``), and a manager with an attribute dcpc does not have,
    stay vLLM's, each named in one warning; cp_lse_ag_out_rs is still replaced."""
    from dcpc.engines import common

    def dcp_a2a_lse_reduce(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False,
                           is_lse_base_on_e=True, seq_lens=None, query_start_loc=None,
                           out=None, scale=None):
        return "vllm a2a"

    class MLADCPManager:
        def __init__(self, vllm_config, device, num_heads, query_head_dim, output_head_dim,
                     query_dtype, output_dtype, padded_num_heads, is_lse_base_on_e, use_pcp):
            self.group = None
            self.fused_out_proj = None

    ops = fake_vllm.ops
    ops.dcp_a2a_lse_reduce, ops.MLADCPManager = dcp_a2a_lse_reduce, MLADCPManager
    monkeypatch.setattr(common, "_logged", set())
    with caplog.at_level("WARNING", logger="dcpc.engines"):
        patched = V.install()
        V.install()
    assert ops.cp_lse_ag_out_rs is V.cp_lse_ag_out_rs
    assert "vllm.v1.attention.ops.dcp.cp_lse_ag_out_rs" in patched
    assert ops.dcp_a2a_lse_reduce is dcp_a2a_lse_reduce and ops.MLADCPManager is MLADCPManager
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "vLLM's own dcp_a2a_lse_reduce stays" in said[0]
    assert "parameter 'scale' is vLLM's, not dcpc's" in said[0]
    assert "vLLM's own MLADCPManager stays" in said[1]
    assert "MLADCPManager.fused_out_proj: vLLM's attribute, not dcpc's" in said[1]


def test_install_leaves_an_unknown_vllm_layout_alone_and_says_so_once(monkeypatch, caplog):
    """Neither vllm.v1.attention.ops.dcp nor dcp_utils imports, or one imports without
    any of the replaced names: install() must not raise (it runs inside the engine's
    plugin loader), patch nothing, and log why once."""
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    other = _module("vllm.v1.attention.ops.dcp_utils", reserve_query_head_storage=None)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.ops.dcp", None)  # import fails
    monkeypatch.setattr(F, "_originals", {})
    from dcpc.engines import common

    monkeypatch.setattr(common, "_logged", set())
    with caplog.at_level("WARNING", logger="dcpc.engines"):
        assert V.install() == [] and V.install() == []
    said = [r.getMessage() for r in caplog.records if "own DCP path stays" in r.getMessage()]
    assert len(said) == 1, said
    assert "vllm.v1.attention.ops.dcp does not import" in said[0]
    assert "vllm.v1.attention.ops.dcp_utils holds none of cp_lse_ag_out_rs" in said[0]


def test_the_contract_command_names_what_dcpc_lacks(tmp_path, capsys):
    """``python -m dcpc.engines.contract PATH`` over a vLLM source tree: each use dcpc's
    adapters do not take is named with its file and line (exit 1); none: exit 0; a path
    that is not there or not a wheel: exit 2 with the reason, no traceback."""
    from dcpc.engines.contract import main

    pkg = tmp_path / "vllm" / "model_executor"
    pkg.mkdir(parents=True)
    (pkg / "layer.py").write_text(textwrap.dedent("""
        def forward(self, q, lse):
            if self.dcp_manager.fused_out_proj is not None:
                return self.dcp_manager.combine(q, lse, seq_lens=None, query_start_loc=None)
            return dcp_a2a_lse_reduce(q, lse, self.group, out=q, scale=2.0)
        """))
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "4 uses of the manager" in out  # two reads, a call of combine, the function
    assert ("missing: vllm/model_executor/layer.py:3: attribute 'fused_out_proj' of the "
            "manager: not dcpc's") in out
    assert ("missing: vllm/model_executor/layer.py:5: dcp_a2a_lse_reduce(...): keyword "
            "'scale' is not a parameter of dcpc's") in out
    assert "combine" not in out.split("missing:", 1)[1]
    (pkg / "layer.py").write_text("x = self.dcp_manager.combine\n")
    assert main([str(tmp_path)]) == 0
    assert main([str(tmp_path / "nothing")]) == 2
    (tmp_path / "broken.whl").write_text("not a zip")
    assert main([str(tmp_path / "broken.whl")]) == 2
    err = capsys.readouterr().err
    assert "nothing: no such file or folder" in err and "broken.whl: cannot be read" in err
