"""SGLang's DeepSeek-V4 DCP collectives parity test (test_dsv4_dcp_collectives), ported
onto dcpc's SGLang adapters: tests/engine_ports/sglang_dsv4.py (source versions, what was
replaced, what was not ported). W = 2 and 3 on the ``local`` backend (the generated
kernels, threads); the ``torch`` (W = 2, 3) and ``host`` (W = 2) backends run it at the
end of tests/engines/test_port_vllm_direct.py."""

from __future__ import annotations

import pytest
from engine_ports.harness import local_run, port_cache, port_cache_dir  # noqa: F401


@pytest.mark.parametrize("world", [2, 3])
def test_local(world):
    found = local_run("engine_ports.sglang_dsv4", world)
    assert [f["sglang_dsv4"] for f in found] == ["ok"] * world
