"""Every dtype of the language (dcpc.lang.nodes.DType) is known to every layer that
keeps a table of dtypes: the emitter's Triton names, the runtime's torch dtypes (the
itemsize agreeing), and for an fp8 dtype the harness's edge bytes (dcpc.harness.synth)."""

from __future__ import annotations

import pytest

from dcpc.codegen import emit
from dcpc.harness import synth
from dcpc.lang.model import DType
from dcpc.runtime import validate


@pytest.mark.parametrize("dtype", list(DType), ids=[d.value for d in DType])
def test_every_layer_knows_the_dtype(dtype: DType) -> None:
    assert dtype.value in emit.TL_DTYPES
    assert validate.DTYPES[dtype.value].itemsize == dtype.itemsize
    fp8 = dtype.is_float and dtype.itemsize == 1
    assert fp8 == (dtype in synth.FP8_EDGES), dtype
    assert fp8 == ("fp8" in dtype.value)
