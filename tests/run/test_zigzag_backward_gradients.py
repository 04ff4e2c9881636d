"""The gallery's zigzag ring backward (schedules/gallery/zigzag_ring_attention_backward.yaml)
computes attention's gradients: its steps, run by the float64 reference (dcpc.harness.
simulate), with each engine step doing what ring-flash-attn's does (a flash-attn backward
on the operands the step declares, the fp32 adds, the casts), give every rank the dq, dk
and dv of its two zigzag chunks that autograd gives for causal attention over the whole
sequence. `dcpc run` (tests/cli/test_gallery.py) checks that the schedule moves what it
says; this checks that what it says is the backward pass: a branch reading the wrong
chunk or slot, or dk/dv that do not end on their owner, would not be these gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpc.harness import simulate
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "schedules" / "gallery" / "zigzag_ring_attention_backward.yaml"
C, H, HK, D = 3, 4, 2, 16
SCALE = D ** -0.5


def attention_backward(dout, q, k, v, out, lse, causal):  # noqa: ANN001, ANN201
    """flash-attn's backward of one call (float64): q [Sq, H, D], k and v [Sk, HK, D],
    lse [H, Sq] (the forward's, over the whole sequence); GQA: head h reads kv head
    h // (H / HK), and dk, dv sum over a kv head's query heads."""
    group = q.shape[1] // k.shape[1]
    kh, vh = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, kh) * SCALE
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), -torch.inf)
    p = torch.exp(s - lse[:, :, None])
    dp = torch.einsum("qhd,khd->hqk", dout, vh)
    ds = p * (dp - (dout * out).sum(-1).T[:, :, None])
    dq = torch.einsum("hqk,khd->qhd", ds, kh) * SCALE
    dk = torch.einsum("hqk,qhd->khd", ds, q) * SCALE
    dv = torch.einsum("hqk,qhd->khd", p, dout)
    fold = (k.shape[0], k.shape[1], group, D)
    return dq, dk.reshape(fold).sum(2), dv.reshape(fold).sum(2)


def engine(step, rank, bufs):  # noqa: ANN001, ANN201
    """Each engine step as ring-flash-attn runs it, on the buffers the step declares."""
    name, reads = step.name, step.op.reads
    cat = torch.cat
    if name == "pack":
        return {f"kv_{i}": cat([bufs[f"k_{i}"], bufs[f"v_{i}"]]) for i in (0, 1)}
    if name.startswith("backward"):
        blocks = [bufs[b] for b in reads if b.startswith(("kv_", "recv_"))]
        k, v = cat([b[:C] for b in blocks]), cat([b[C:] for b in blocks])
        halves = (1,) if name.startswith("backward_upper") else (0, 1)
        q, dout, out, lse = (cat([bufs[f"{n}_{i}"] for i in halves], dim=1 if n == "lse" else 0)
                             for n in ("q", "dout", "out", "lse"))
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=name == "backward_first")
        # the rows each writes: dq_buffer[:, :seqlen_q], dk_buffer[:, :seqlen_kv]
        got = {f"dq_blk_{i}": dq[i * C:(i + 1) * C] for i in range(len(halves))}
        got |= {f"dk_blk_{i}": dk[i * C:(i + 1) * C] for i in range(len(blocks))}
        got |= {f"dv_blk_{i}": dv[i * C:(i + 1) * C] for i in range(len(blocks))}
        assert set(got) == set(step.op.writes), (name, sorted(got))
        return got
    if name == "init":  # dq = dq_buffer.to(float32), dk and dv likewise
        return {"dq_acc_0": bufs["dq_blk_0"], "dq_acc_1": bufs["dq_blk_1"],
                **{f"dkv_{i}": cat([bufs[f"dk_blk_{i}"], bufs[f"dv_blk_{i}"]]) for i in (0, 1)}}
    if name.startswith("dq_upper"):  # dq[:, C:] += dq_buffer[:, :C]
        return {"dq_acc_1": bufs["dq_acc_1"] + bufs["dq_blk_0"]}
    if name.startswith("dq_lower"):  # dq += dq_buffer
        return {f"dq_acc_{i}": bufs[f"dq_acc_{i}"] + bufs[f"dq_blk_{i}"] for i in (0, 1)}
    if name.startswith("dkv_"):  # the running dk/dv of the block in hand (its chunks)
        return {acc: bufs[acc] + cat([bufs[f"dk_blk_{i}"], bufs[f"dv_blk_{i}"]])
                for i, acc in enumerate(step.op.writes)}
    if name == "finish":
        home = [bufs[b] for b in reads if b.startswith("dkv_")]
        return {"dq_0": bufs["dq_acc_0"], "dq_1": bufs["dq_acc_1"],
                **{f"dk_{i}": home[i][:C] for i in (0, 1)},
                **{f"dv_{i}": home[i][C:] for i in (0, 1)}}
    raise AssertionError(f"no engine step {name}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_backward_pass_gives_causal_attention_s_gradients(world: int) -> None:
    schedule = parse_file(FILE, world)
    gen = torch.Generator().manual_seed(world)
    n = 2 * world * C  # the whole sequence, 2W chunks of C tokens

    def bf16(*shape: int) -> torch.Tensor:  # drawn as the buffers store them
        return torch.randn(*shape, generator=gen, dtype=torch.float64).bfloat16().double()

    q, k, v, dout = bf16(n, H, D), bf16(n, HK, D), bf16(n, HK, D), bf16(n, H, D)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    group = H // HK
    s = torch.einsum("qhd,khd->hqk", qa, ka.repeat_interleave(group, 1)) * SCALE
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    lse = torch.logsumexp(s, -1)  # [H, n]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), va.repeat_interleave(group, 1))
    out.backward(dout)

    def chunk(t: torch.Tensor, j: int, dim: int = 0) -> torch.Tensor:
        return t.narrow(dim, j * C, C).detach()

    stored = {"q": q, "k": k, "v": v, "dout": dout, "out": out.detach()}
    inputs = []
    for r in range(world):  # rank r: chunks r and 2W - 1 - r
        mine = (r, 2 * world - 1 - r)
        bufs = {f"{name}_{i}": simulate.as_stored(schedule, f"{name}_{i}", chunk(t, j))
                for name, t in stored.items() for i, j in enumerate(mine)}
        bufs |= {f"lse_{i}": simulate.as_stored(schedule, f"lse_{i}", chunk(lse, j, 1))
                 for i, j in enumerate(mine)}
        inputs.append(bufs)
    ends = simulate.simulate_call(schedule, world, {"C": C, "H": H, "HK": HK, "D": D}, inputs,
                                   engine)
    for r in range(world):
        for i, j in enumerate((r, 2 * world - 1 - r)):
            for name, grad in (("dq", qa.grad), ("dk", ka.grad), ("dv", va.grad)):
                want = chunk(grad, j)
                got = ends[r][f"{name}_{i}"]
                # bf16 operands and results (dq_buffer, out, the outputs): seen up to 0.009
                torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max(),
                                           msg=f"{name}[{i}] (chunk {j}) on rank {r}, W={world}")
