"""Generated modules in one process (W = 1): every shipped schedule runs through its
methods on the Triton kernels (host backend; a one-rank group needs no shared memory)
and on the torch backend, with poisoned buffers and random inputs; construction and
call arguments are validated with errors that name what is wrong."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.kernels import SCHEDULES, compile_file, compile_text, load, the_class

from dcpc.runtime import DcpcArgumentError, merge


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", category=RuntimeWarning)


@pytest.fixture(scope="module")
def classes(tmp_path_factory) -> dict[str, type]:
    out = tmp_path_factory.mktemp("gen1")
    return {p.stem: the_class(load(compile_file(p, out))) for p in SCHEDULES.glob("*.yaml")}


def rand(*shape: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) + 0.5).to(dtype)


MLA = ["kimi_k3_dcp", "kimi_k3_dcp_fused", "kimi_k3_dcp_staging", "kimi_k3_dcp_ag_rs"]


@pytest.mark.parametrize("backend", ["host", "torch"])
@pytest.mark.parametrize("name", MLA)
def test_mla_schedules_at_one_rank(classes, name, backend):
    m = classes[name](
        None, sizes={"H": 2, "T": 6, "B": 3}, backend=backend, programs=2, poison=True
    )
    T, H = 5, 2
    seq_lens = torch.tensor([4, 0, 2], dtype=torch.int32)  # request 1 empty
    qsl = torch.tensor([0, 2, 3, 4], dtype=torch.int32)  # token 4 is padding
    for slot in (1, 0):
        q = rand(T, H, 576, seed=slot)
        q_full = m.query_gather(q, slot=slot)
        if name == "kimi_k3_dcp_staging":
            q_full = m.query_copy(slot=slot)
        assert torch.equal(q_full, q)
        o, lse = rand(T, H, 512, seed=10 + slot), torch.randn(T, H) * 2
        masked = merge.empty_mask(seq_lens, qsl, T, 1, 1)
        ref, ref_lse = merge.lse_combine(
            o[None].double(), lse[None].double(), "e", masked, torch.float64
        )
        if name == "kimi_k3_dcp_fused":
            out, out_lse = m.combine(o, lse, seq_lens, qsl, slot=slot)
            torch.testing.assert_close(out_lse.double(), ref_lse)
        elif name == "kimi_k3_dcp_ag_rs":
            assert torch.equal(m.lse_gather(lse, slot=slot)[0], lse)
            m.correct(o, seq_lens, qsl, slot=slot)
            out = m.out_scatter(slot=slot)
        else:
            o_recv, lse_recv = m.out_exchange(o, lse, slot=slot)
            assert torch.equal(o_recv[0], o) and torch.equal(lse_recv[0], lse)
            out = m.merge(seq_lens, qsl, slot=slot)
        assert out.shape == (T, H, 512) and out.dtype == torch.bfloat16
        assert not torch.isnan(out).any()
        assert (out[2] == 0).all() and (out[4] == 0).all(), "empty request, padding row"
        torch.testing.assert_close(
            out.double(), ref.to(torch.bfloat16).double(), rtol=1.6e-2, atol=1e-2
        )
    m.close()


@pytest.mark.parametrize("backend", ["host", "torch"])
def test_kv_gather_at_one_rank_and_run_time_sizes(classes, backend):
    m = classes["kv_gather"](None, sizes={"N": 8}, backend=backend, programs=3)
    for n in (8, 1, 5):
        kv = rand(n, 576, seed=n)
        full = m.kv_gather(kv)
        assert full.shape == (n, 576) and torch.equal(full, kv)
        m.release()
    assert m._env[0]["N"] == 5


def test_constructor_validates_sizes(classes):
    cls = classes["kimi_k3_dcp"]
    with pytest.raises(ValueError, match="size H is bound at construction"):
        cls(None, sizes={"T": 4})
    with pytest.raises(ValueError, match=r"size T can only be lowered from its maximum 512 "
                       r"\(1..512\), got 600"):
        cls(None, sizes={"H": 2, "T": 600})
    with pytest.raises(ValueError, match="size D is the constant 576"):
        cls(None, sizes={"H": 2, "D": 512})
    with pytest.raises(ValueError, match="unknown size 'X'"):
        cls(None, sizes={"H": 2, "X": 1})
    with pytest.raises(ValueError, match="timeout_s"):
        cls(None, sizes={"H": 2}, timeout_s=0)


def test_methods_validate_their_arguments(classes):
    def fresh(**kw):  # an argument error fails the instance (the guard): one per case
        return classes["kimi_k3_dcp"](None, sizes={"H": 2, "T": 4, "B": 2}, programs=1, **kw)

    with pytest.raises(DcpcArgumentError, match=r"query_gather\(\): argument 'q_local' .* T "):
        fresh().query_gather(rand(5, 2, 576))
    with pytest.raises(DcpcArgumentError, match=r"argument 'q_local' has dtype torch.float32"):
        fresh().query_gather(torch.zeros(3, 2, 576))
    with pytest.raises(DcpcArgumentError, match=r"slot must be an int in 0..1, got 2"):
        fresh().query_gather(rand(3, 2, 576), slot=2)
    with pytest.raises(DcpcArgumentError, match=r"merge\(\): .*size T is not bound yet"):
        fresh(guard=False).merge(
            torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), slot=1
        )
    with pytest.raises(DcpcArgumentError, match=r"sizes= binds run-time sizes"):
        fresh().merge(
            torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), sizes={"H": 3}
        )


SYNC_SCHEDULE = """
schedule: split_sync
slots: 2
sizes: {T: {max: 4}}
buffers:
  x: {shape: [T, W], dtype: f32, symmetric: true}
steps:
  - produce:  {op: external, writes: [x]}
  - publish:  {op: signal, to: next, channel: x}
  - consume:  {op: wait, from: prev, channel: x}
  - publish_all:  {op: signal, channel: x}
  - everyone: {op: barrier}
"""


def test_split_phase_sync_at_one_rank(tmp_path):
    cls = the_class(load(compile_text(SYNC_SCHEDULE, tmp_path)))
    for backend in ("host", "torch"):
        m = cls(None, sizes={}, backend=backend)
        for call in range(3):
            for step in ("publish", "consume", "publish_all", "everyone"):
                getattr(m, step)(slot=call % 2)
        if backend == "host":
            assert int(m._bank.epochs[1 * 2 + 0, 0]) == 2  # publish, slot 0: calls 0 and 2
            assert int(m._bank.epochs[2 * 2 + 1, 0]) == 1  # consume, slot 1: call 1
