"""dcpc.engines without a group: the schedules an engine's dims give, the compile cache,
the input layouts passed without a copy, the env switches, and the local math
(vLLM's correct_attn_out, the source mask, the workspace size) against the float64
reference."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dcpc.engines import common, reference
from dcpc.engines import vllm as V
from dcpc.engines.combine import fit_layout, mask_at_source
from dcpc.engines.common import CombineSpec, GatherSpec
from dcpc.runtime.errors import DcpcArgumentError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(common, "_classes", {})
    return tmp_path


def test_schedule_text_is_w_independent_and_names_its_checked_range():
    spec = CombineSpec("fused", 64)
    text = common.schedule_text(spec, 2)
    assert text == common.schedule_text(spec, 8)  # one module for W 2..8
    assert "H: {multiple_of: W}" in text and "checked for W 2..8" in text
    assert "checked for W 2..12" in common.schedule_text(spec, 12)
    assert common.schedule_text(CombineSpec("fused", 64, lse_base="2"), 2) != text


def test_the_cache_key_covers_the_code_generator(monkeypatch):
    """A module emitted by other templates is never taken from the cache."""
    text = common.schedule_text(CombineSpec("fused", 16), 2)
    key = common.cache_key(text)
    assert key == hashlib.sha256((text + common._generator()).encode()).hexdigest()
    monkeypatch.setattr(common, "_generator", lambda: "other templates")
    assert common.cache_key(text) != key


@pytest.mark.parametrize("spec", [
    CombineSpec("a2a", 16), CombineSpec("fused", 16, mask=False, return_lse=False),
    CombineSpec("ag_rs", 16, o_dtype="f16", out_dtype="f16", slots=2),
    CombineSpec("fused", 16, out_dtype="fp8e4m3"), GatherSpec("q", 24), GatherSpec("kv", 8),
])
def test_every_spec_compiles_through_the_full_check(cache, spec):
    cls = common.module_class(spec, 3)
    text = common.schedule_text(spec, 3)
    key = common.cache_key(text)
    assert (cache / f"{key[:32]}.py").exists()
    assert (cache / f"{key[:32]}.yaml").read_text() == text
    assert not [p for p in cache.iterdir() if p.name.startswith(".dcpc-")]  # atomic writes
    assert cls.SLOTS == spec.slots
    if isinstance(spec, CombineSpec):
        assert ("lens_gather" in cls.STEPS) == spec.mask
        assert ("release" in cls.STEPS) == (spec.path != "ag_rs")


def test_a_cached_module_imports_without_the_compiler(cache):
    spec = CombineSpec("fused", 16)
    common.module_class(spec, 2)
    code = textwrap.dedent("""
        import sys
        for name in ("pydantic", "networkx", "jinja2"):
            sys.modules[name] = None  # any import of them fails
        from dcpc.engines import common
        from dcpc.engines.common import CombineSpec
        cls = common.module_class(CombineSpec("fused", 16), 2)
        print("OK", cls.__name__)
        try:
            common.module_class(CombineSpec("fused", 24), 2)  # not cached: must compile
        except ImportError:
            print("COMPILE NEEDS THE COMPILER")
    """)
    env = {**os.environ, "DCPC_CACHE_DIR": str(cache), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK Dcpc" in proc.stdout and "COMPILE NEEDS THE COMPILER" in proc.stdout


@pytest.mark.parametrize("spec, word", [
    (CombineSpec("allreduce", 16), "path"), (CombineSpec("a2a", 16, lse_base="10"), "lse_base"),
    (CombineSpec("a2a", 16, slots=3), "slots"), (GatherSpec("k", 16), "gather kind"),
])
def test_bad_specs_are_argument_errors(spec, word):
    with pytest.raises(DcpcArgumentError, match=word):
        common.schedule_text(spec)


def test_strided_engine_inputs_pass_without_a_copy(cache):
    fused = common.module_class(CombineSpec("fused", 16), 2)
    ag_rs = common.module_class(CombineSpec("ag_rs", 16), 2)
    out = torch.randn(5, 8, 24)[..., :16]  # a padded attention output, sliced
    lse = torch.randn(8, 5).t()  # FA's head-major LSE, transposed: strides (1, 5)
    assert fit_layout(fused, "combine", "o_part", out) is out
    assert fit_layout(fused, "combine", "lse_part", lse) is lse
    assert fit_layout(ag_rs, "correct", "o_part", out) is out
    assert fit_layout(ag_rs, "lse_gather", "lse_part", lse) is lse
    every_other = torch.randn(5, 8, 32)[..., ::2]  # last dim not contiguous: copied
    got = fit_layout(fused, "combine", "o_part", every_other)
    assert got is not every_other and got.is_contiguous() and torch.equal(got, every_other)


@pytest.mark.parametrize("value, want", [(None, "auto"), ("", "auto"), ("1", "on"),
                                         ("true", "on"), ("0", "off"), ("False", "off")])
def test_switches(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("VLLM_USE_DIRECT_DCP_A2A", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_DIRECT_DCP_A2A", value)
    assert common.switch("VLLM_USE_DIRECT_DCP_A2A") == want


def test_a_bad_switch_value_is_refused(monkeypatch):
    monkeypatch.setenv("VLLM_USE_DIRECT_DCP_A2A", "maybe")
    with pytest.raises(DcpcArgumentError, match="VLLM_USE_DIRECT_DCP_A2A='maybe'"):
        common.switch("VLLM_USE_DIRECT_DCP_A2A")


@pytest.mark.parametrize("base2", [False, True])
def test_correct_attn_out_matches_reference_in_place(base2):
    g = torch.Generator().manual_seed(3)
    out = torch.randn(4, 1, 6, 16, generator=g).bfloat16()  # [B, 1, H, D]: squeezed
    lses = torch.randn(3, 4, 6, generator=g) * 2
    lses[:, 0, 0] = float("-inf")  # a row every rank masked: output 0
    lses[1, 1, 2] = float("nan")  # NaN counts as -inf
    lses[1, 2, 3] = float("inf")  # so does +inf
    out[1, 0, 2] = float("nan")  # rank 1 (this rank) is masked there: no NaN may leak
    want_out, want_lse = reference.vllm_correct_attn_out(out.squeeze(1), lses, 1, base2)
    got_out, got_lse = V.correct_attn_out(out, lses, 1, None, is_lse_base_on_e=not base2)
    assert got_out.data_ptr() == out.data_ptr()  # in place, as vLLM
    assert not torch.isnan(got_out).any()
    torch.testing.assert_close(got_out.double(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_lse.double(), want_lse)


def test_correct_attn_out_checks_its_rank():
    with pytest.raises(DcpcArgumentError, match="cp_rank 3"):
        V.correct_attn_out(torch.zeros(2, 4, 8), torch.zeros(3, 2, 4), 3)


def test_source_mask_matches_reference():
    lse = torch.randn(7, 4)
    lens = torch.tensor([2, 0, 5], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 4, 5], dtype=torch.int32)  # rows 5, 6: padding
    got = mask_at_source(lse, lens, qsl)
    assert torch.equal(got.double(), reference.source_mask(lse, lens, qsl))
    assert torch.isinf(got[2:4]).all() and torch.isinf(got[5:]).all()
    assert torch.isfinite(got[:2]).all() and torch.isfinite(got[4]).all()
    empty = mask_at_source(lse, lens[:0], qsl[:1])
    assert torch.isinf(empty).all()


def test_mask_arguments_come_together():
    with pytest.raises(ValueError, match="together"):
        V.dcp_a2a_lse_reduce(torch.zeros(2, 4, 8), torch.zeros(2, 4), None,
                             seq_lens=torch.ones(1, dtype=torch.int32))


def test_workspace_tokens_without_vllm():
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=64),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=512))
    assert V.get_dcp_workspace_max_num_tokens(cfg) == 512  # max(64 * 2, 512)
    cfg.compilation_config.max_cudagraph_capture_size = None
    assert V.get_dcp_workspace_max_num_tokens(cfg) == 128
    cfg.scheduler_config.max_num_batched_tokens = 100
    assert V.get_dcp_workspace_max_num_tokens(cfg) == 100


def test_workspace_tokens_with_drafting_slots_follow_vllm_0_34():
    """vLLM 0.34.0's formula without vLLM: tokens per sequence = max(1 + k,
    max_decode_query_len) with max_decode_query_len = 1 + k + the speculator's extra
    drafting slots: 4 sequences, k = 3, 3 slots -> 28; no slots -> 16. parallel_drafting
    (0.33.0's 1 + 2k) is deprecated in 0.34.0 with no effect: it changes nothing."""
    spec = SimpleNamespace(num_speculative_tokens=3, parallel_drafting=True,
                           max_num_new_slots_for_drafting=3)
    cfg = SimpleNamespace(
        speculative_config=spec, num_speculative_tokens=3,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=4),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=None))
    assert V.get_dcp_workspace_max_num_tokens(cfg) == 28
    spec.max_num_new_slots_for_drafting = 0
    assert V.get_dcp_workspace_max_num_tokens(cfg) == 16
    del spec.max_num_new_slots_for_drafting  # a config without the field: no slots
    assert V.get_dcp_workspace_max_num_tokens(cfg) == 16


def test_out_is_written_and_returned_also_on_one_rank():
    """dcp_a2a_lse_reduce(..., out=) (vLLM 0.34.0): on one rank vLLM still runs its merge
    into ``out`` (weight 1 per live row; a masked or NaN row is 0, LSE -inf) and returns
    that buffer; an ``out`` of the wrong shape is refused naming the expected one."""
    o = torch.randn(3, 2, 4)
    o[2] = float("nan")
    lse = torch.tensor([[0.5, 1.0], [float("nan"), 2.0], [1.0, 1.0]])
    buf = torch.full((3, 2, 4), 7.0)
    got, got_lse = V.dcp_a2a_lse_reduce(o, lse, None, out=buf, return_lse=True,
                                         seq_lens=torch.tensor([1, 2]),
                                         query_start_loc=torch.tensor([0, 1, 2]))
    assert got is buf
    assert torch.equal(buf[0], o[0]) and torch.equal(buf[1, 1], o[1, 1])
    assert torch.equal(buf[1, 0], torch.zeros(4)) and torch.equal(buf[2], torch.zeros(2, 4))
    assert got_lse[1, 0] == float("-inf") and got_lse[2].eq(float("-inf")).all()
    assert torch.equal(got_lse[0], lse[0])
    with pytest.raises(DcpcArgumentError, match=r"out has shape \(3, 1, 4\).*expected \(3, 2, 4\)"):
        V.dcp_a2a_lse_reduce(o, lse, None, out=torch.empty(3, 1, 4))


def test_a_single_rank_group_returns_its_inputs():
    out, lse = torch.randn(3, 4, 8), torch.randn(3, 4)
    got = V.cp_lse_ag_out_rs(out, lse, None, return_lse=True)
    assert got[0] is out and got[1] is lse
    assert V.dcp_a2a_lse_reduce(out, lse, None) is out
