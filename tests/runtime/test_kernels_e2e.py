"""Generated modules across processes (host backend: Triton interpreter + shared memory),
started by dcpc.harness.launch: a peer that never arrives is a DcpcTimeoutError naming
step, peer and epoch; epochs wrap past int32; host and torch backends agree with the
float64 reference on the comm kernels (gather with interleave, reduce_scatter, fused
exchange + merge) at W = 3."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
from support.kernels import SCHEDULES, compile_file, load, the_class

from dcpc.harness.launch import launch

pytestmark = pytest.mark.host


def _module(path: str) -> type:
    warnings.filterwarnings("ignore")
    os.environ["TRITON_INTERPRET"] = "1"
    return the_class(load(path))


def timeout_worker(rank: int, world: int, path: str, done: str) -> dict[str, Any]:
    """Rank 1 constructs, then stays away, alive (a dead one is named dead at once),
    until rank 0 has given up (the file ``done``; 600 s at most)."""
    import time

    import torch.distributed as dist

    from dcpc.runtime import DcpcTimeoutError

    cls = _module(path)
    m = cls(
        dist.group.WORLD, sizes={"N": 4}, backend="host", programs=1, timeout_s=3, epoch_start=41
    )
    if rank == 1:
        until = time.monotonic() + 600
        while time.monotonic() < until and not os.path.exists(done):
            time.sleep(0.2)
        return {"rank": 1}
    import torch

    try:
        m.kv_gather(torch.randn(4, 576).bfloat16())
    except DcpcTimeoutError as exc:
        return {"step": exc.step, "peer": exc.peer, "epoch": exc.epoch, "text": str(exc)}
    finally:
        open(done, "w").close()
    return {"error": "no timeout"}


def test_absent_peer_is_a_timeout_naming_step_peer_and_epoch(tmp_path):
    path = compile_file(SCHEDULES / "kv_gather.yaml", tmp_path)
    result = launch("test_kernels_e2e:timeout_worker", 2,
                    {"path": str(path), "done": str(tmp_path / "done")}, timeout_s=900)
    assert result.ok, result.summary() + result.outcomes[0].traceback
    got = result.values()[0]
    assert (got["step"], got["peer"], got["epoch"]) == ("kv_gather", 1, 42), got
    assert "rank 0 timed out waiting for peer 1" in got["text"]


def wrap_worker(rank: int, world: int, path: str, calls: int) -> int:
    import torch
    import torch.distributed as dist

    cls = _module(path)
    m = cls(
        dist.group.WORLD,
        sizes={"N": 6},
        backend="host",
        programs=2,
        epoch_start=2**31 - 3,
        poison=True,
    )
    bad = 0
    for call in range(calls):
        n = 2 + call % 5
        rows = [
            torch.randn(n, 576, generator=torch.Generator().manual_seed(call * 10 + r))
            for r in range(world)
        ]
        full = m.kv_gather(rows[rank].bfloat16())
        want = torch.stack(rows, 1).reshape(world * n, 576).bfloat16()  # row j of r -> j*W+r
        bad += int(not torch.equal(full, want))
        m.release()
    assert int(m._bank.epochs.min()) < 0, "the epochs did wrap past int32"
    m.close()
    return bad


def test_epochs_wrap_past_int32(tmp_path):
    path = compile_file(SCHEDULES / "kv_gather.yaml", tmp_path)
    result = launch(
        "test_kernels_e2e:wrap_worker", 2, {"path": str(path), "calls": 5}, timeout_s=400
    )
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    assert result.values() == [0, 0]


def parity_worker(rank: int, world: int, paths: dict[str, str]) -> dict[str, float]:
    """Run the ag_rs and fused schedules on host and torch backends; float64 reference."""
    import torch
    import torch.distributed as dist

    from dcpc.runtime import merge

    H, T, D, Dv = 2 * world, 3, 576, 512
    g = torch.Generator().manual_seed(7)
    o_all = (torch.randn(world, T, H, Dv, generator=g)).bfloat16()
    lse_all = torch.randn(world, T, H, generator=g) * 2
    seq_lens = torch.tensor([1, 7], dtype=torch.int32)  # request 0: ranks >= 1 are empty
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)  # token 2 is padding
    masked = merge.empty_mask(seq_lens, qsl, T, world, 1)
    ref, ref_lse = merge.lse_combine(o_all.double(), lse_all.double(), "e", masked, torch.float64)
    mine = slice(rank * H // world, (rank + 1) * H // world)
    q = torch.randn(world, T, H // world, D, generator=g).bfloat16()
    errors: dict[str, float] = {}
    for name, path in sorted(paths.items()):
        cls = _module(path)
        for backend in ("host", "torch"):
            m = cls(
                dist.group.WORLD,
                sizes={"H": H, "T": 4, "B": 2},
                backend=backend,
                programs=2,
                poison=True,
            )
            for slot in (1, 0):
                q_full = m.query_gather(q[rank], slot=slot)
                assert torch.equal(q_full, q.transpose(0, 1).reshape(T, H, D)), (name, backend)
                if name == "fused":
                    out, out_lse = m.combine(o_all[rank], lse_all[rank], seq_lens, qsl, slot=slot)
                    torch.testing.assert_close(out_lse.double(), ref_lse[:, mine])
                else:
                    lse_full = m.lse_gather(lse_all[rank], slot=slot)
                    assert torch.equal(lse_full, lse_all)
                    m.correct(o_all[rank], seq_lens, qsl, slot=slot)
                    out = m.out_scatter(slot=slot)
                err = (out.double() - ref[:, mine]).abs().max().item()
                assert not torch.isnan(out).any()
                errors[f"{name}/{backend}/{slot}"] = err
            m.close()
    return errors


def test_host_and_torch_backends_match_reference_at_w3(tmp_path):
    paths = {
        "fused": str(compile_file(SCHEDULES / "kimi_k3_dcp_fused.yaml", tmp_path)),
        "ag_rs": str(compile_file(SCHEDULES / "kimi_k3_dcp_ag_rs.yaml", tmp_path)),
    }
    result = launch("test_kernels_e2e:parity_worker", 3, {"paths": paths}, timeout_s=600)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    for errors in result.values():
        assert len(errors) == 8
        # bf16 output (and, for ag_rs, a bf16 corrected partial before the sum)
        assert max(errors.values()) < 0.05, errors
