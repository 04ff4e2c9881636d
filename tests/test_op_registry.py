"""The op registry holds each fact about an op once: which keys of a step name buffers
(and whether the step reads or writes them) is dcpc.lang.nodes.BUFFER_KEYS, which the
checker's reference and aliasing rules read; an op whose model has a buffer field not
listed there is refused when it is defined, so the lists cannot drift."""

from __future__ import annotations

import pytest
from pydantic import Field

import dcpc.lang.model  # noqa: F401  (registers every op)
from dcpc.lang.nodes import BUFFER_KEYS, Name, OpBase
from dcpc.ops.registry import OPS, OpDef, buffer_fields, define


def test_every_op_s_buffer_fields_are_listed_once() -> None:
    seen = {f for op in OPS.values() for f in buffer_fields(op.model)}
    assert seen == set(BUFFER_KEYS)  # no listed key without an op, none missing
    assert set(BUFFER_KEYS.values()) == {"read", "write"}
    assert buffer_fields(OPS["signal"].model) == []  # a channel is not a buffer


def test_an_op_with_an_unlisted_buffer_key_is_refused() -> None:
    class Odd(OpBase):
        src: Name
        dst: Name
        scratch: Name | list[Name] = Field(default="x")

    ref = OPS["copy"]
    odd = OpDef("odd_copy", Odd, ref.semantics, ref.verify, ref.reference, ref.io)
    with pytest.raises(ValueError, match=r"'odd_copy'.*\['scratch'\].*BUFFER_KEYS"):
        define(odd)
    assert "odd_copy" not in OPS


def test_the_checker_reads_and_writes_by_the_table() -> None:
    from dcpc.check.ops import READ_KEYS, WRITTEN_KEYS

    assert set(READ_KEYS) | set(WRITTEN_KEYS) == set(BUFFER_KEYS)
    assert not set(READ_KEYS) & set(WRITTEN_KEYS)
    assert {"dst", "via", "return_lse", "recv_counts"} <= set(WRITTEN_KEYS)
    assert {"src", "counts", "index", "output_scale"} <= set(READ_KEYS)
