"""dcpc.runtime on its own: shapes, argument checks, tiles, heaps, the signal bank and
the reference merge (checked against a naive per-row float64 loop)."""

from __future__ import annotations

import math

import pytest
import torch

from dcpc.numerics import FP8_FORMATS, SCALE_FLOOR, SCALE_MAX, SCALE_MIN
from dcpc.runtime import merge, rendezvous, shapes, sync, tiles
from dcpc.runtime.backend import make_heap, resolve_backend
from dcpc.runtime.errors import DcpcArgumentError, DcpcTimeoutError
from dcpc.runtime.heap import LocalHeap, aligned_offsets
from dcpc.runtime.validate import Signature

T_, H_W = ("sym", "T"), ("/", ("sym", "H"), ("sym", "W"))


def test_shapes_evaluate_exactly_and_find_linear_bindings():
    env = {"H": 8, "W": 2, "T": 3}
    assert shapes.shape([T_, H_W, ("num", 576)], env) == (3, 4, 576)
    with pytest.raises(ValueError, match="not a whole number"):
        shapes.evaluate(H_W, {"H": 7, "W": 2})
    assert shapes.linear_in(("+", ("sym", "B"), ("num", 1)), "B", {}) == (1, 1)
    assert shapes.linear_in(("*", ("sym", "W"), ("sym", "N")), "N", {"W": 4}) == (4, 0)
    assert shapes.linear_in(("*", ("sym", "N"), ("sym", "N")), "N", {}) is None
    assert shapes.unparse(("*", ("sym", "W"), ("+", ("sym", "N"), ("num", 1)))) == "W*(N+1)"


def signature() -> Signature:
    params = [
        ("q_local", (T_, H_W, ("num", 8)), "bf16"),
        ("query_start_loc", (("+", ("sym", "B"), ("num", 1)),), "i32"),
    ]
    return Signature("gather", params, {"H": 8, "W": 2}, {"T": 16, "B": 4}, torch.device("cpu"))


def test_signature_binds_sizes_from_argument_shapes():
    env = signature().bind(
        (torch.zeros(5, 4, 8, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32)),
        {"H": 8, "W": 2},
    )
    assert env["T"] == 5 and env["B"] == 2


def test_signature_memo_repeats_only_what_it_checked():
    """The memo of a bind: the same env object and argument layouts give the same env
    back (interned: equal envs are one object), strides included; a new layout, a size
    out of range or another env object is checked again."""
    def make(a: int, b: int) -> Signature:
        return Signature("gather", [("q_local", (T_, H_W, ("num", 8)), "bf16")],
                         {"H": 8, "W": 2}, {"T": 16}, torch.device("cpu"),
                         [("q_local", a, b, True)])

    sig = make(1, 2)  # axes [T], [H/W], [8]
    start = {"H": 8, "W": 2}
    packed = torch.zeros(5, 4, 8, dtype=torch.bfloat16)
    strided = torch.zeros(5, 6, 8, dtype=torch.bfloat16)[:, 1:5]
    a = sig.bind((packed,), start)
    assert sig.strides == [(32, 8, 1)]
    b = sig.bind((strided,), start)
    assert sig.strides == [(48, 8, 1)] and b == a and b is a  # interned, strides its own
    assert sig.bind((packed.clone(),), start) is a and sig.strides == [(32, 8, 1)]
    assert sig.bind((packed,), dict(start)) is a  # another env object: checked, same sizes
    with pytest.raises(DcpcArgumentError, match="T outside 0..16"):
        sig.bind((torch.zeros(17, 4, 8, dtype=torch.bfloat16),), start)
    with pytest.raises(DcpcArgumentError, match="dims 1 and 2 cannot be read as one axis"):
        make(0, 1).bind((torch.zeros(5, 4, 9, dtype=torch.bfloat16)[:, :, :8],), start)


@pytest.mark.parametrize(
    "q,qsl,match",
    [
        (torch.zeros(17, 4, 8, dtype=torch.bfloat16), None, r"'q_local' .* T outside 0..16"),
        (torch.zeros(5, 3, 8, dtype=torch.bfloat16), None, r"'q_local' has shape \(5, 3, 8\)"),
        (torch.zeros(5, 4, 8), None, r"'q_local' has dtype torch.float32, expected"),
        (torch.zeros(4, 5, 8).bfloat16().transpose(0, 1), None, "'q_local' is not contiguous"),
        (None, torch.zeros(9, dtype=torch.int32), r"'query_start_loc' .* B outside 0..4"),
        ([1, 2], None, "'q_local' is a list, expected a torch.Tensor"),
    ],
)
def test_signature_errors_name_method_argument_and_expectation(q, qsl, match):
    q = torch.zeros(5, 4, 8, dtype=torch.bfloat16) if q is None else q
    qsl = torch.zeros(3, dtype=torch.int32) if qsl is None else qsl
    with pytest.raises(DcpcArgumentError, match=r"gather\(\): argument " + match):
        signature().bind((q, qsl), {"H": 8, "W": 2})


def test_tiles_prefer_exact_power_of_two_columns():
    assert tiles.pick(576, 4096, True) == (64, 64)
    assert tiles.pick(512, 4096, True) == (8, 512)
    assert tiles.pick(7, 4096, True) == (512, 8)
    assert tiles.pick(512 * 96, 4096, False) == (4, 1024)


def test_local_heap_aligns_and_publishes_its_own_address():
    heap = LocalHeap(0, 1, torch.device("cpu"), poison=True)
    a, b = heap.allocate([10, 300])
    assert a.local.data_ptr() % 256 == 0 and b.local.data_ptr() % 256 == 0
    assert int(b.peer_ptrs[0]) == b.local.data_ptr()
    assert torch.isnan(b.view(torch.float32, (75,))).all(), "poison fills NaN"
    assert aligned_offsets([10, 300, 1]) == ([0, 256, 768], 1024)
    with pytest.raises(RuntimeError):
        heap.allocate([1])


def test_backend_resolution_on_cpu():
    assert resolve_backend("auto", None, torch.device("cpu")) == "host"
    assert resolve_backend("torch", None, torch.device("cpu")) == "torch"
    assert isinstance(make_heap("host", None, torch.device("cpu")), LocalHeap)  # one rank
    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("nccl", None, torch.device("cpu"))


def test_signal_bank_starts_at_epoch_start_and_reports_timeouts():
    heap = LocalHeap(0, 1, torch.device("cpu"), poison=True)
    (seg,) = heap.allocate([sync.signal_nbytes(4, 1, 2)])
    bank = sync.SignalBank(seg, 4, 1, 2, torch.device("cpu"), epoch_start=2**31 - 2)
    assert (bank.sig == 2**31 - 2).all() and (bank.epochs == 2**31 - 2).all()
    assert (bank.flags == 0).all()  # no peer failed (the poison is cleared)
    bank.check_errors(["a", "b"])  # nothing recorded
    record = [sync.TIMEOUT, 1, 0, -(2**31), 0, 0, 0, 0]
    bank.errors.copy_(torch.tensor(record, dtype=torch.int32))
    with pytest.raises(DcpcTimeoutError, match="step 'b'.*peer 0 .* epoch -2147483648") as err:
        bank.check_errors(["a", "b"], rank=1)
    assert (err.value.step, err.value.peer, err.value.epoch) == ("b", 0, -(2**31))
    assert sync.wrap_int32(2**31) == -(2**31)
    with pytest.raises(ValueError):
        sync.SignalBank(seg, 4, 1, 2, torch.device("cpu"), epoch_start=2**31)


@pytest.mark.parametrize("name,record,words", [
    ("OVER_CAPACITY", [0, 1, 3, 9, 8, 1, 0, 0],
     "step 'b': peer 3 routed 9 rows to rank 1, over the capacity 8"),
    ("BAD_INDEX", [0, 0, 5, 12, 10, 0, 0, 0],
     "step 'a': rank 1's index of token 5 holds row 12, past the 10 rows of x"),
    ("BAD_SCALE", [0, 1, 0, 0x7FC00000, 0, 0, 0, 0], "step 'b': rank 1's fp8 scale is nan"),
    ("OUTSIDE_SLOT", [0, 1, 2, 4, 4, 0, 0, 4],
     "step 'b': rank 1's index places a row for rank 2 (slot 3 of counts) at row 4 of "
     "its slot, outside [0, capacity 4)"),
])
def test_an_op_s_error_code_is_one_row_of_the_errors_table(name, record, words):
    """An op's kernel error code is defined once (errors.KERNEL_ERRORS): the kernels'
    DCPC_<name> (dcpc.runtime.device, which emit imports from) and the host's decoding
    of a recorded error (SignalBank.check_errors) both come from its row."""
    from dcpc.codegen.emit import device_names
    from dcpc.runtime import device, errors

    code = errors.KERNEL_ERRORS[name].code
    for row, error in errors.KERNEL_ERRORS.items():  # every row's constant, off no row
        assert getattr(device, f"DCPC_{row}").value == error.code, row
        assert f"DCPC_{row}" in device_names(), row
    formats = {f"DCPC_{fmt[3:].upper()}_{what}" for fmt in FP8_FORMATS  # their grids
               for what in ("TOP", "MANTISSA", "MIN_EXP")}
    # scale_fault's bounds, and the fp8 casts' amax floor (templates/ops/ragged_all_to_all)
    scale = {"DCPC_SCALE_MIN": SCALE_MIN, "DCPC_SCALE_MAX": SCALE_MAX,
             "DCPC_SCALE_FLOOR": SCALE_FLOOR}
    assert {n: getattr(device, n).value for n in scale} == scale
    assert {n for n in vars(device) if n.startswith("DCPC_") and not n.endswith("_WORD")
            and n not in ("DCPC_FLAG_FAILED", *formats, *scale)} == {
        f"DCPC_{r}" for r in errors.KERNEL_ERRORS}
    assert len({e.code for e in errors.KERNEL_ERRORS.values()}) == len(errors.KERNEL_ERRORS)
    heap = LocalHeap(0, 1, torch.device("cpu"), poison=True)
    (seg,) = heap.allocate([sync.signal_nbytes(4, 1, 2)])
    bank = sync.SignalBank(seg, 4, 1, 2, torch.device("cpu"))
    bank.errors.copy_(torch.tensor([code, *record[1:]], dtype=torch.int32))
    with pytest.raises(errors.DcpcArgumentError) as err:
        bank.check_errors(["a", "b"], rank=1)
    assert str(err.value).startswith(words), str(err.value)


def naive_merge(o, lse, base, masked):
    """One row at a time, straight from domain.md, in float64."""
    W = lse.shape[0]
    exp, log = (math.exp, math.log) if base == "e" else ((lambda v: 2.0**v), math.log2)
    out = torch.zeros(o.shape[1:], dtype=torch.float64)
    total = torch.zeros(lse.shape[1:], dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in lse.shape[1:]]).tolist():
        idx = tuple(idx) if isinstance(idx, list) else (idx,)
        ls = []
        for p in range(W):
            v = float(lse[(p, *idx)])
            if math.isnan(v) or v == math.inf or (masked is not None and masked[p, idx[0]]):
                v = -math.inf
            ls.append(v)
        m = max(ls)
        m = 0.0 if m == -math.inf else m
        s = sum(exp(v - m) for v in ls)
        big = m + (log(s) if s > 0 else -math.inf)
        total[idx] = big
        for p in range(W):
            if ls[p] != -math.inf:
                out[idx] += exp(ls[p] - big) * o[(p, *idx)].double()
    return out, total


@pytest.mark.parametrize("base", ["e", "2"])
def test_reference_merge_matches_naive_loop(base):
    g = torch.Generator().manual_seed(1)
    o = torch.randn(3, 4, 2, 5, generator=g, dtype=torch.float64)
    lse = torch.randn(3, 4, 2, generator=g, dtype=torch.float64) * 2
    lse[0, 0, 0], lse[1, 0, 1] = float("nan"), float("inf")
    lse[:, 1, 0] = float("-inf")
    o[:, 1, 0] = float("nan")
    masked = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]], dtype=torch.bool)
    o[0, 2], o[2, 0], o[2, 3] = float("inf"), float("nan"), float("nan")
    got, got_lse = merge.lse_combine(o, lse, base, masked, torch.float64)
    want, want_lse = naive_merge(o, lse, base, masked)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_lse, want_lse)
    assert not torch.isnan(got).any() and (got[1, 0] == 0).all()


def test_empty_mask_follows_the_local_length_formula():
    seq = torch.tensor([5, 1, 8], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    mask = merge.empty_mask(seq, qsl, 6, 2, 2)  # I = 2, W = 2; tokens 4, 5 are padding
    for p in range(2):
        for t, req in enumerate([0, 1, 1, 2]):
            n = seq[req].item()
            local = sum(1 for tok in range(n) if (tok // 2) % 2 == p)
            assert bool(mask[p, t]) == (local == 0)
    assert mask[:, 4:].all()


@pytest.mark.parametrize(
    ("rows", "programs", "want"),
    [
        (256, 128, (72, 32, 64)),  # query gather T=8, H=64 at W=2: 36 tiles -> 72 (not 144)
        (384, 128, (108, 32, 64)),  # H=96: 54 -> 108
        (32, 128, (18, 16, 64)),  # T=1: split down to 1024 elements, 18 tiles
        (2048, 128, (128, 64, 64)),  # enough tiles already: unchanged
        (256, 4, (4, 64, 64)),  # CPU cap: 36 tiles >= 4 programs
    ],
)
def test_small_calls_get_shorter_tiles_and_fewer_programs(rows, programs, want):
    from dcpc.runtime.module import MIN_BLOCK, ScheduleModule, Tune

    tune = Tune(programs, 4, 4096, tiles=[(64, 64)])
    grid, block_r, block_c = ScheduleModule._launch(tune, rows, 576)
    assert (grid, block_r, block_c) == want
    assert block_r * block_c >= MIN_BLOCK and grid <= programs
    assert grid == min(programs, -(-rows // block_r) * -(-576 // block_c))


@pytest.mark.parametrize(
    ("block_r", "block_c", "group", "warps", "want"),
    [
        (8, 128, 128, 4, (4, 128, 4)),  # the H100's wrong [8, 128] f32 tile: 4 rows
        (8, 256, None, 4, (2, 256, 4)),  # per token, rows of 256: 2 rows
        (4, 1024, None, 4, (1, 512, 4)),  # a column tile past 4 warps' vectors: halved
        (4, 256, 1024, 4, (1, 256, 8)),  # a group of 1024: one row on 8 warps
        (2, 128, 16, 4, (2, 128, 4)),  # already one vector a thread: unchanged
    ],
)
def test_fp8_stores_get_one_row_vector_a_thread(block_r, block_c, group, warps, want):
    """ScheduleModule._fp8_tile: at most FP8_VECTOR elements of the stored tile a thread
    (benchmarks/diag/grouped_cast_a2a: two rows a thread stored wrong fp8 on an H100)."""
    from dcpc.runtime.module import FP8_VECTOR, WARP_THREADS, ScheduleModule, Tune

    got = ScheduleModule._fp8_tile(Tune(128, warps, 4096), block_r, block_c, group)
    assert got == want
    r, c, w = got
    assert r * (group or c) <= FP8_VECTOR * WARP_THREADS * w


def test_request_lookup_is_a_vector_up_to_1024_requests():
    assert [tiles.request_block(b) for b in (1, 3, 256, 1024)] == [1, 4, 256, 1024]
    assert tiles.request_block(1025) == 0  # binary search beyond


def test_construction_facts_past_one_message_fold_into_a_digest_that_still_differs():
    """A long unrolled schedule (two tuning facts per step: double_ring at 2x3 has 84) was
    refused at construction over gloo ("84 construction facts, at most 63"); the facts
    now fold into one message, and a difference among the folded ones is still named."""
    facts = [("schedule", 7)] + [(f"tuning['s{i}']['programs']", 2) for i in range(90)]
    folded = rendezvous.fold(facts)
    assert len(folded) == rendezvous.MESSAGE - 1 and folded[:62] == facts[:62]
    assert rendezvous.fold(facts[:63]) == facts[:63]  # what fits is sent as it is
    other = facts[:80] + [("tuning['s79']['block']", 3)] + facts[81:]
    theirs = {r: [len(f), *(v for _, v in f)]
              for r, f in enumerate([folded, rendezvous.fold(other)])}
    with pytest.raises(DcpcArgumentError, match=r"one of tuning\['s61'\]\['programs'\] \.\. "
                       r"tuning\['s89'\]\['programs'\] \(29 facts\)"):
        rendezvous._compare("DoubleRing", 0, folded, theirs)
    rendezvous._compare("DoubleRing", 0, folded, {0: theirs[0], 1: list(theirs[0])})
