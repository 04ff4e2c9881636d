"""The eager host fast path (dcpc.runtime.calls, issue 24 item 3): a repeat call replays
its call plan, and no plan is ever replayed for a call whose tensors, slot or sizes
differ in anything the checked path looks at. Each case changes one property after a
plan exists and checks the error the checked path raises, or the new result."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from support.kernels import SCHEDULES, compile_file, load, the_class

from dcpc.runtime import DcpcArgumentError, DcpcContractError, DcpcFailedError, calls, merge

H, T_MAX = 2, 6


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", category=RuntimeWarning)


@pytest.fixture(scope="module")
def classes(tmp_path_factory) -> dict[str, type]:
    out = tmp_path_factory.mktemp("plans")
    return {p.stem: the_class(load(compile_file(p, out))) for p in SCHEDULES.glob("*.yaml")}


def rand(*shape: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) + 0.5).to(dtype)


def module(classes, name: str = "kimi_k3_dcp", **kw):
    return classes[name](None, sizes={"H": H, "T": T_MAX, "B": 3}, backend="host",
                         programs=2, poison=True, **kw)


def requests(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_lens and query_start_loc of 3 requests over t tokens (request 1 empty)."""
    cut = [0, min(2, t), min(2, t), t]
    return torch.tensor([4, 0, 2], dtype=torch.int32), torch.tensor(cut, dtype=torch.int32)


def one_call(m, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query_gather, out_exchange, merge at t tokens; (out, float64 reference)."""
    q = rand(t, H, 576, seed=seed)
    assert torch.equal(m.query_gather(q), q)
    o, lse = rand(t, H, 512, seed=seed + 1), torch.randn(t, H) * 2
    m.out_exchange(o, lse)
    seq_lens, qsl = requests(t)
    out = m.merge(seq_lens, qsl)
    masked = merge.empty_mask(seq_lens, qsl, t, 1, 1)
    ref, _ = merge.lse_combine(o[None].double(), lse[None].double(), "e", masked,
                               torch.float64)
    return out, ref


def test_every_method_of_every_shipped_schedule_replays_a_plan(classes):
    """No method falls back to its checked path silently: after one call, each has a
    plan, and the repeat call with new data (same metadata) gives the new result."""
    for name in ("kimi_k3_dcp", "kimi_k3_dcp_fused", "kimi_k3_dcp_staging",
                 "kimi_k3_dcp_ag_rs"):
        m = module(classes, name)
        for seed in (0, 1):
            q = rand(5, H, 576, seed=seed)
            assert torch.equal(m.query_gather(q), q)
            if name == "kimi_k3_dcp_staging":
                assert torch.equal(m.query_copy(), q)
        assert {key[0] for key in m._plans} == set(m.METHODS) - {"out_exchange", "merge",
                                                                 "combine", "lse_gather",
                                                                 "correct", "out_scatter"}
        m.close()
    m = module(classes)
    one_call(m, 5, 0)
    out, ref = one_call(m, 5, 7)  # every step replayed, with other data
    assert {key[0] for key in m._plans} == set(m.METHODS)
    assert len(m._plans) == len(m.METHODS)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double(), rtol=1.6e-2,
                               atol=1e-2)
    kv = classes["kv_gather"](None, sizes={"N": 8}, backend="host", programs=3)
    for seed in (0, 1):
        x = rand(8, 576, seed=seed)
        assert torch.equal(kv.kv_gather(x), x)
        kv.release()
    assert {key[0] for key in kv._plans} == set(kv.METHODS)


def test_the_torch_backend_makes_no_plans(classes):
    m = classes["kimi_k3_dcp"](None, sizes={"H": H, "T": T_MAX, "B": 3}, backend="torch")
    one_call(m, 5, 0)
    one_call(m, 5, 1)
    assert m._plans == {}


def test_fused_combine_replays_with_new_inputs(classes):
    m = module(classes, "kimi_k3_dcp_fused")
    seq_lens, qsl = requests(5)
    masked = merge.empty_mask(seq_lens, qsl, 5, 1, 1)
    for seed in (0, 1, 2):
        m.query_gather(rand(5, H, 576, seed=seed))
        o, lse = rand(5, H, 512, seed=seed), torch.randn(5, H) * 2
        out, out_lse = m.combine(o, lse, seq_lens, qsl)
        ref, ref_lse = merge.lse_combine(o[None].double(), lse[None].double(), "e", masked,
                                         torch.float64)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out_lse.double(), ref_lse)
        torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double(),
                                   rtol=1.6e-2, atol=1e-2)
    (plan,) = [p for k, p in m._plans.items() if k[0] == "combine"]
    poisoned = [a for a in plan.actions if isinstance(a, torch.Tensor)]
    assert len(poisoned) == 2  # poison=True: out and out_lse, before every launch


@pytest.mark.parametrize("t_new", [3, 6, 0])
def test_other_sizes_bound_by_an_earlier_step_are_not_replayed(classes, t_new):
    """merge's own arguments do not change with T (the slot's sizes do): its plan must
    not be replayed after query_gather bound another T in the slot."""
    m = module(classes)
    one_call(m, 5, 0)
    one_call(m, 5, 1)
    out, ref = one_call(m, t_new, 2)
    assert out.shape == (t_new, H, 512)
    torch.testing.assert_close(out.double(), ref.to(torch.bfloat16).double(), rtol=1.6e-2,
                               atol=1e-2)
    q = rand(5, H, 576, seed=3)
    assert m.query_gather(q).shape == (5, H, 576)  # back to T = 5: its plan again
    assert m._fp == m._fps.of("query_gather", m._env[0])


def _planned(classes):
    m = module(classes)
    q = rand(5, H, 576, seed=0)
    m.query_gather(q)
    m.query_gather(q)
    assert any(k[0] == "query_gather" for k in m._plans)
    return m


@pytest.mark.parametrize("arg, says", [
    (lambda: rand(7, H, 576), r"argument 'q_local' has size 7 in dimension 0 .* outside 0..6"),
    (lambda: rand(5, H + 1, 576), r"argument 'q_local' has shape \(5, 3, 576\)"),
    (lambda: rand(5, H, 576, dtype=torch.float16), r"has dtype torch.float16, expected"),
    (lambda: torch.empty(5, H, 576, dtype=torch.bfloat16, device="meta"), r"is on meta"),
    (lambda: [[0.0] * 576] * 5, r"argument 'q_local' is a list, expected a torch.Tensor"),
    (lambda: np.zeros((5, H, 576), dtype=np.float32), r"is a ndarray, expected a torch"),
])
def test_a_changed_argument_gets_the_checked_paths_error(classes, arg, says):
    m = _planned(classes)
    with pytest.raises(DcpcArgumentError, match=says):
        m.query_gather(arg())
    with pytest.raises(DcpcFailedError, match="failed earlier"):
        m.query_gather(rand(5, H, 576))  # a planned key: the failed instance still refuses


@pytest.mark.parametrize("slot, sizes, says", [
    (True, None, r"slot must be an int in 0..1, got True"),
    (2, None, r"slot must be an int in 0..1, got 2"),
    (-1, None, r"slot must be an int in 0..1, got -1"),
    (0, 0, r"sizes must be a dict, got 0"),
    (0, {"H": 3}, r"sizes= binds run-time sizes"),
    (0, {"T": 9}, r"size T=9 is outside 0..6"),
])
def test_a_changed_slot_or_sizes_gets_the_checked_paths_error(classes, slot, sizes, says):
    m = _planned(classes)
    with pytest.raises(DcpcArgumentError, match=says):
        m.query_gather(rand(5, H, 576), slot=slot, sizes=sizes)


def test_changed_strides_and_storage_give_the_new_result(classes):
    m = _planned(classes)
    rows = rand(5, H, 600, seed=4)[:, :, :576]  # strided rows: another key, same shape
    assert torch.equal(m.query_gather(rows), rows)
    moved = torch.empty(H, 5, 576, dtype=torch.bfloat16).transpose(0, 1)
    moved.copy_(rand(5, H, 576, seed=5))
    assert torch.equal(m.query_gather(moved), moved)
    q = rand(5, H, 576, seed=6)
    assert torch.equal(m.query_gather(q), q)
    q.set_(rand(5, H, 576, seed=7))  # the same tensor object on another storage
    assert torch.equal(m.query_gather(q), q)
    q.resize_(3, H, 576)  # the same object, resized in place
    assert m.query_gather(q).shape == (3, H, 576)
    seq_lens, qsl = requests(3)
    m.out_exchange(rand(3, H, 512), torch.randn(3, H))
    m.merge(seq_lens, qsl)
    m.out_exchange(rand(3, H, 512), torch.randn(3, H))
    with pytest.raises(DcpcArgumentError, match="argument 'seq_lens' is not contiguous"):
        m.merge(torch.arange(6, dtype=torch.int32)[::2], qsl)


def test_replay_keeps_the_call_order_and_the_closed_instance(classes):
    m = module(classes)
    one_call(m, 5, 0)
    one_call(m, 5, 1)
    m.query_gather(rand(5, H, 576))
    seq_lens, qsl = requests(5)
    with pytest.raises(DcpcContractError, match=r"called before out_exchange\(\)"):
        m.merge(seq_lens, qsl)  # a planned key, out of the contract's order
    m = module(classes)
    q = rand(5, H, 576)
    m.query_gather(q)
    m.query_gather(q)
    m.close()
    with pytest.raises(DcpcFailedError, match="was closed"):
        m.query_gather(q)


def test_a_record_with_a_tensor_the_module_does_not_own_is_not_kept():
    mine, theirs, made = torch.zeros(2), torch.zeros(3), torch.zeros(4)
    owned = {id(mine): mine}
    kernel = object()
    ok = calls.launches([mine, (kernel, (2,), (theirs, mine, 5), {"B": 1})], (theirs,), owned)
    assert ok is not None and ok[0] is mine
    launch = ok[1]
    assert launch.subs == ((0, 0),) and launch.args[0] is None and launch.args[1] is mine
    assert calls.launches([(kernel, (2,), (made,), {})], (theirs,), owned) is None
    assert calls.launches([made], (theirs,), owned) is None  # poisoned: not owned
    assert calls.launches([(kernel, (2,), (theirs,), {})], (theirs, theirs), owned) is None
    assert calls.launches([(kernel, (2,), ([1],), {})], (), owned) is None
    assert calls.launches([(kernel, (2,), (), {"X": made})], (), owned) is None
