"""The CPU interpreter's shim (dcpc.runtime.local._install_interpreter_threads) makes
Triton 3.6's interpreter cheaper without changing an answer: its NumPy dtype of every
Triton type is the original's, a ``tl.tuple``'s type, made at its first read, is the
one Triton made at construction, and a kept block type is the one Triton makes; the
host ranks of one run share each rewrite of their module (dcpc.harness.interpret)."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl
from triton.language import core
from triton.runtime import interpreter

from dcpc.runtime.local import _install_interpreter_threads

pytestmark = pytest.mark.skipif(not triton.__version__.startswith("3.6."),
                                reason="the shim's speed-ups are for Triton 3.6")


def _answer(fn, tt):  # noqa: ANN001, ANN202 (a value or the exception's class)
    try:
        return fn(tt)
    except Exception as exc:  # noqa: BLE001
        return type(exc)


def test_the_numpy_dtype_of_every_triton_type_is_the_original_s() -> None:
    _install_interpreter_threads()
    memo = interpreter._get_np_dtype
    original = memo.__wrapped__
    scalars = [v for v in vars(tl).values()
               if isinstance(v, tl.dtype) and not isinstance(v, tl.block_type)]
    scalars += [tl.pointer_type(tl.int64), tl.pointer_type(tl.bfloat16), tl.void]
    assert len(scalars) > 20
    for t in scalars:
        for tt in (t, tl.block_type(t, [4, 8]), tl.block_type(t, [16])):
            want = _answer(original, tt)
            assert _answer(memo, tt) == want, tt
            assert _answer(memo, tt) == want, tt  # asked again: from the memo


def test_a_tuple_s_type_made_at_its_first_read_is_the_one_made_at_construction() -> None:
    _install_interpreter_threads()
    values = [2, tl.constexpr(8), tl.float32, 1.5]
    t = core.tuple(values)
    want = core._type_for_tuple_values(values)
    assert t.type == want and str(t.type) == str(want) == "[:constexpr_type[2],:" \
        "constexpr_type[8],:constexpr_type[fp32],:constexpr_type[1.5]]"
    assert t.type is t.type  # made once
    given = core.tuple_type([tl.int32, tl.int64], ["a", "b"])
    named = core.tuple([3, 4], given)
    assert named.type is given and named.a == 3 and named.b == 4
    from_list = core.tuple([3, 4], [tl.int32, tl.int64])
    assert from_list.type == core.tuple_type([tl.int32, tl.int64])
    t._setitem(0, 5)  # Triton's own update: the type follows the new value
    assert t.type == core._type_for_tuple_values([5, tl.constexpr(8), tl.float32, 1.5])
    assert t.values[0] == 5 and len(t) == 4


@triton.jit
def _int32_arithmetic(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x * 3 + x - 7)


def test_the_overflow_test_nothing_reads_is_not_built() -> None:
    """Triton 3.6 builds a range test for every int32 add, sub and mul and hands it to
    ``device_assert``, which drops it while the debug option is off (the interpreter's
    options are always the defaults): the shim turns ``sanitize_overflow`` off, and the
    kernel's wrapped int32 values are NumPy's."""
    import numpy as np
    import torch

    _install_interpreter_threads()
    options = interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow
    semantic = interpreter.interpreter_semantic
    false = semantic.tensor(interpreter.TensorHandle(np.zeros(4, dtype=bool), tl.int1),
                            tl.block_type(tl.int1, [4]))
    assert semantic.device_assert(false, "never", None) is None  # debug off: dropped
    x = torch.tensor([0, 1, -5, 2**31 - 1, -(2**31), 1 << 29, 123456789, -1],
                     dtype=torch.int32)
    out = torch.empty_like(x)
    _int32_arithmetic[(1,)](x, out, N=8)
    want = x.numpy().astype(np.int32)
    with np.errstate(over="ignore"):
        want = want * np.int32(3) + want - np.int32(7)
    assert out.tolist() == want.tolist()


def test_a_kept_block_type_is_the_one_triton_makes_and_tensors_keep_their_shapes() -> None:
    """The builder's block types and ``with_element_ty``'s are kept per (element type,
    shape): equal to (same name, shape, numel) a new one, the same object when asked
    again, another for another element type or shape; a tensor of one has its own
    ``tl.tuple`` shape of ``constexpr``s and its numel, as Triton's constructor makes
    them; two blocks of one shape broadcast to themselves, others as before."""
    _install_interpreter_threads()
    builder, semantic = interpreter.interpreter_builder, interpreter.interpreter_semantic
    for element in (tl.float32, tl.int1, tl.pointer_type(tl.bfloat16),
                    tl.pointer_type(tl.int64, 1, True)):
        for shape in ([4, 8], [tl.constexpr(16)], [2, 1, 4]):
            want = tl.block_type(element, shape)
            got = builder.get_block_ty(element, shape)
            assert got == want and (got.name, got.shape, got.numel) == (
                want.name, want.shape, want.numel), (element, shape)
            assert builder.get_block_ty(element, list(want.shape)) is got
            assert want.with_element_ty(tl.int8) is builder.get_block_ty(tl.int8, shape)
            t = core.tensor(None, got)
            assert isinstance(t.shape, core.tuple) and t.shape == want.shape
            assert all(isinstance(d, tl.constexpr) for d in t.shape)
            assert t.numel == want.numel and t.dtype == element and t.type is got
            assert t.shape is not core.tensor(None, got).shape  # each tensor's own
    assert builder.get_block_ty(tl.pointer_type(tl.int64), [4]) is not \
        builder.get_block_ty(tl.pointer_type(tl.int64, 1, True), [4])  # const differs
    scalar = core.tensor(None, tl.float32)
    assert scalar.shape == core.tuple([]) and scalar.numel == 1
    a = semantic.arange(0, 8)
    b = semantic.arange(0, 8)
    assert semantic.broadcast_impl_value(a, b) == (a, b)
    col = semantic.expand_dims(a, 1)
    left, right = semantic.broadcast_impl_value(col, semantic.expand_dims(b, 0))
    assert list(left.shape) == list(right.shape) == [8, 8]


KERNEL = '''import triton
import triton.language as tl


@triton.jit
def fill(out_ptr, N: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, N), tl.full([N], {value}, tl.float32))
'''


def test_a_run_s_ranks_share_each_rewrite_of_its_module(tmp_path) -> None:  # noqa: ANN001
    """``share_rewrites``: the first process to rewrite a function of the shared module
    stores the compiled rewrite beside it; another (here the same file imported again:
    a new function, as in another rank) runs the stored code, not its own rewrite of the
    source: a stored rewrite of another body shows. A module not shared is rewritten
    from its source, as Triton does."""
    import importlib.util
    import marshal

    import torch

    from dcpc.harness.interpret import share_rewrites

    _install_interpreter_threads()

    def load(path, name):  # noqa: ANN001, ANN202
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def filled(module) -> list[float]:  # noqa: ANN001
        out = torch.zeros(4)
        module.fill[(1,)](out, N=4)
        return out.tolist()

    shared, other = tmp_path / "shared.py", tmp_path / "other.py"
    shared.write_text(KERNEL.format(value="1.0"))
    other.write_text(KERNEL.format(value="3.0"))
    store = tmp_path / "run" / "rewrites"  # the run's folder, not beside the module
    share_rewrites(str(shared), str(store))
    assert filled(load(shared, "dcpc_shared_rank0")) == [1.0] * 4
    (entry,) = [p for p in store.iterdir() if p.name != "lock"]
    assert entry.name.endswith(".fill.5")
    assert filled(load(shared, "dcpc_shared_rank1")) == [1.0] * 4  # the stored one
    made = load(other, "dcpc_other_rank0")
    assert filled(made) == [3.0] * 4  # not shared: its own source, nothing stored
    assert [p.name for p in store.iterdir() if p.name != "lock"] == [entry.name]
    assert not list(tmp_path.glob("*.rewrites"))  # nothing beside the modules
    # the store holds another body now: a later rank runs it, whatever its source says
    entry.write_bytes(marshal.dumps(compile(
        "def fill(out_ptr, N: tl.constexpr):\n    tl.store(out_ptr + tl.arange(0, N), "
        "tl.full([N], 2.0, tl.float32))\n", str(shared), "exec")))
    assert filled(load(shared, "dcpc_shared_rank2")) == [2.0] * 4
    # a cut entry (a full disk): Triton's own rewrite of the source, not an error
    entry.write_bytes(entry.read_bytes()[:10])
    assert filled(load(shared, "dcpc_shared_rank3")) == [1.0] * 4
