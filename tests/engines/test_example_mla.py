"""examples/mla_decode: an engine-style decode loop over the generated kimi_k3_dcp module.

The end-to-end test runs the example as a user would (two processes, gloo, the host
backend under the Triton interpreter) and checks that DCP attention equals attention
over the whole cache at every step, greedy tokens included. The first tests check the
example's own attention and interleave rule without any dcpc code.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mla_decode"
sys.path.insert(0, str(EXAMPLE))

from attention import (  # noqa: E402
    local_seq_len,
    mla_decode_attention,
    owner_rank,
    shard_of,
)


def test_local_seq_len_counts_the_tokens_the_interleave_rule_puts_on_each_rank() -> None:
    for world, interleave in [(2, 1), (3, 1), (4, 2), (8, 16)]:
        for seq_len in range(0, 3 * world * interleave + 2):
            for rank in range(world):
                held = sum(owner_rank(t, world, interleave) == rank for t in range(seq_len))
                got = local_seq_len(torch.tensor(seq_len), rank, world, interleave)
                assert int(got) == held, (world, interleave, seq_len, rank)


def _merge(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """domain.md's merge, written out: o [W, T, H, Dv], lse [W, T, H]."""
    m = lse.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    total = m + torch.log(torch.exp(lse - m).sum(0))
    w = torch.exp(lse - total)
    return torch.where(w[..., None] > 0, w[..., None] * o.float(), 0.0).sum(0)


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 1), (3, 2)])
def test_shard_attention_merged_with_lse_weights_equals_full_attention(world, interleave):
    g = torch.Generator().manual_seed(world)
    seq_lens = torch.tensor([1, 2, 7, 30], dtype=torch.int32)  # short ones: empty shards
    qsl = torch.arange(5, dtype=torch.int32)
    q = torch.randn(6, 3, 576, generator=g)  # 4 requests + 2 padding rows
    kv_full = torch.randn(4, 30, 576, generator=g)
    ref, _ = mla_decode_attention(q, kv_full, seq_lens, qsl)

    parts = []
    for rank in range(world):
        shard = torch.zeros(4, 30, 576)
        for b, n in enumerate(seq_lens.tolist()):
            rows = shard_of(kv_full[b, :n], rank, world, interleave)
            shard[b, : rows.shape[0]] = rows
        parts.append(mla_decode_attention(q, shard, seq_lens, qsl, rank=rank, world=world,
                                          interleave=interleave))
    o = torch.stack([p[0] for p in parts])
    lse = torch.stack([p[1] for p in parts])
    assert torch.isinf(lse[:, 0]).any(), "a 1-token request leaves some shard empty"
    assert torch.isnan(o[:, 0]).any(), "an empty shard's output is garbage, as kernels leave it"
    merged = _merge(o[:, :4], lse[:, :4])
    torch.testing.assert_close(merged, ref[:4], rtol=1e-5, atol=1e-5)


def _run_example(tmp_path: Path, *args: str, timeout_s: int = 240) -> tuple[dict, str]:
    """Run decode.py in its own process group so a hang can be cleaned up completely."""
    result = tmp_path / "result.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "MASTER_PORT": str(20000 + os.getpid() % 20000)}
    cmd = [sys.executable, str(EXAMPLE / "decode.py"), "--json", str(result), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the example and the ranks it spawned
        log, _ = proc.communicate()
        pytest.fail(f"the example did not finish in {timeout_s}s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-4000:]
    return json.loads(result.read_text()), log


@pytest.mark.e2e
@pytest.mark.host
def test_dcp_decode_loop_matches_single_rank_attention_every_step(tmp_path: Path) -> None:
    steps, batches = 3, ["0,1,6,2,40", "2,0,13"]  # 5 and 3 requests: 8 and 4 padded rows
    got, log = _run_example(tmp_path, "--world", "2", "--heads", "4", "--backend", "host",
                            "--programs", "4", "--steps", str(steps), "--batches", *batches)
    assert got["passed"], log[-4000:]
    assert got["steps"] == steps
    assert got["rows_checked"] == steps * (5 + 3)
    assert got["tolerance_violations"] == 0 and got["nonfinite"] == 0
    assert math.isfinite(got["max_abs_err"]) and got["max_abs_err"] < 0.05
    # Both microbatches (slots 0 and 1) carried CUDA-graph padding rows, merged to 0.
    assert got["padded_rows"] == [8, 4]
    assert got["padding_rows"] == steps * (3 + 1) and got["padding_rows_nonzero"] == 0
    # Step 0 has two 1-token requests: rank 1's shard is empty and its kernel left a
    # garbage LSE there ("--empty-lse garbage"); only the merge's mask keeps it out.
    assert got["empty_lse"] == "garbage" and got["rows_with_empty_shard"] == 2
    assert got["tokens_checked"] == steps * (5 + 3)
    assert got["token_matches"] + got["near_ties"] == got["tokens_checked"]
    assert got["token_mismatches"] == 0
