"""The CPU interpreter's shim (dcpc.runtime.local._install_interpreter_threads) makes
Triton 3.6's interpreter cheaper without changing an answer: its NumPy dtype of every
Triton type is the original's, and a ``tl.tuple``'s type, made at its first read, is the
one Triton made at construction."""

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
