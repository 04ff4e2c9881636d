"""torch backend (gloo): a peer that is gone before a handshake makes every gloo call of
``TorchHandshake.exchange`` (isend included, which raised a raw gloo RuntimeError:
"[gloo/.../pair.cc] Connection closed by peer") raise a Dcpc error naming the step,
the slot, this rank and the peer. W = 2 processes; rank 1 leaves at once."""

from __future__ import annotations

import time
from typing import Any

import pytest

from dcpc.harness.launch import launch

pytestmark = pytest.mark.liveness


def worker(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from dcpc.runtime.guard import TorchHandshake
    from dcpc.runtime.sync import Fingerprints

    if rank == 1:
        dist.destroy_process_group()  # its connections close: a peer that is gone
        return []
    shake = TorchHandshake([dist.group.WORLD], 0, 2, ["push"], 20.0,
                           Fingerprints({"push": ()}, {}, "0"))
    time.sleep(1.0)  # rank 1 has closed its side
    seen = []
    for _ in range(3):  # the first may fail in the wait; the later in isend itself
        try:
            shake.exchange("push", 0, 0, 7)
            seen.append("ok")
        except Exception as err:  # noqa: BLE001 - reported, then asserted on
            seen.append(f"{type(err).__module__}.{type(err).__name__}: {err}")
    return seen


def test_handshake_with_a_peer_gone_raises_dcpc_errors() -> None:
    result = launch("test_guard_gloo:worker", 2, timeout_s=120, gloo_timeout_s=20)
    seen: Any = result.outcomes[0].value
    assert result.outcomes[0].status == "ok", result.summary()
    assert len(seen) == 3, seen
    for text in seen:
        assert text.startswith("dcpc.runtime.errors.DcpcPeerFailedError: step 'push': rank 0 "
                               "stopped waiting for peer 1"), seen
        assert "is unreachable (slot 0; gloo:" in text, seen
