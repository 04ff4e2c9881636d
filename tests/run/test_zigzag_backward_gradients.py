"""The gallery's zigzag ring backward (schedules/gallery/zigzag_ring_attention_backward.yaml)
computes attention's gradients: its steps, run by the float64 reference (dcpc.harness.
simulate), with each engine step doing what ring-flash-attn's does (a flash-attn backward
on the operands the step declares, the fp32 adds, the casts), give every rank the dq, dk
and dv of its two zigzag chunks that autograd gives for causal attention over the whole
sequence, for each of a batch of B = 2 sequences (the engine's q, k, v, out, dout of [B,
2C, ...] viewed as [B, 2, C, ...], softmax_lse of [B, H, 2C] as [B, H, 2, C], read whole
or by their chunks q[:, i], lse[:, :, i]). `dcpc run` (tests/cli/test_gallery.py) checks
that the schedule moves what it says; this checks that what it says is the backward
pass: a branch reading the wrong chunk or slot, or dk/dv that do not end on their owner,
would not be these gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpc import pipeline
from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "schedules" / "gallery" / "zigzag_ring_attention_backward.yaml"
B, C, H, HK, D = 2, 3, 4, 2, 16
SCALE = D ** -0.5


def attention_backward(dout, q, k, v, out, lse, causal):  # noqa: ANN001, ANN201
    """flash-attn's backward of one call (float64): q [B, Sq, H, D], k and v [B, Sk, HK,
    D], lse [B, H, Sq] (the forward's, over the whole sequence); GQA: head h reads kv head
    h // (H / HK), and dk, dv sum over a kv head's query heads."""
    group = q.shape[2] // k.shape[2]
    kh, vh = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kh) * SCALE
    if causal:
        s = s.masked_fill(torch.ones(s.shape[2:], dtype=torch.bool).triu(1), -torch.inf)
    p = torch.exp(s - lse[..., None])
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vh)
    ds = p * (dp - (dout * out).sum(-1).transpose(1, 2)[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kh) * SCALE
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * SCALE
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    fold = (k.shape[0], k.shape[1], k.shape[2], group, D)
    return dq, dk.reshape(fold).sum(3), dv.reshape(fold).sum(3)


def of(names, buffer: str) -> list[str]:  # noqa: ANN001
    """The chunks of ``buffer`` among ``names`` (unrolled names: ``dq_acc_1``), in order,
    or the buffer itself where it is read whole (``q``)."""
    return [n for n in names if n.rsplit("_", 1)[0] == buffer]


def engine(step, rank, bufs):  # noqa: ANN001, ANN201
    """Each engine step as ring-flash-attn runs it (its name says which), on the operands
    the step declares: what it reads from ``step.op.reads``, where it writes from
    ``step.op.writes``; a step must write every buffer it declares and nothing else."""
    got = run_engine_step(step.name, step.op.reads, step.op.writes, bufs)
    assert set(got) == set(step.op.writes), (step.name, sorted(got))
    return got


def run_engine_step(name: str, reads: list[str], writes: list[str], bufs):  # noqa: ANN001, ANN201
    cat = torch.cat

    def put(targets: list[str], values) -> dict:  # noqa: ANN001
        return dict(zip(targets, values, strict=True))

    def add(acc: str, part: list[torch.Tensor]) -> dict:  # an in-place add: acc += part
        assert of(writes, acc) == of(reads, acc), name
        return put(of(writes, acc), [bufs[a] + p for a, p in zip(of(reads, acc), part,
                                                                   strict=True)])

    def read(buffer: str) -> list[torch.Tensor]:
        return [bufs[n] for n in of(reads, buffer)]

    def tokens(buffer: str, axis: int = 1) -> torch.Tensor:
        """The rows the step reads of ``buffer`` as the source's tensor: the whole, [B, 2,
        C, ...] (lse: [B, H, 2, C], ``axis`` 2) seen as [B, 2C, ...], or its chunk."""
        if buffer in reads:  # read whole: a free view of the source's [B, 2C, ...]
            return bufs[buffer].flatten(axis, axis + 1)
        return cat(read(buffer), dim=axis)

    def block(buffer: str) -> torch.Tensor:
        """k or v of the block in hand as the source passes it, [B, Sk, HK, D]: the own
        one (step 0), a received slot (recv_k_<s>, [B, 2, C, ...]) or its first chunk
        (recv_k_<s>_0, a view of the slot: k0)."""
        (got,) = [n for n in reads if n == buffer or n.startswith(f"recv_{buffer}_")]
        return bufs[got].flatten(1, 2) if bufs[got].dim() == 5 else bufs[got]

    def chunks(buffer: str) -> torch.Tensor:  # dk_blk's chunks read: whole, or the first
        part = read(buffer)
        return torch.stack(part, 1) if len(part) == 2 else part[0]

    def running(buffer: str, names: list[str]) -> list[str]:  # dk_acc_<s>, dk_acc_<s>_0
        return [n for n in names if n.startswith(f"{buffer}_")]

    if name.startswith("backward"):
        k, v = block("k"), block("v")
        q, dout, out = (tokens(n) for n in ("q", "dout", "out"))
        dq, dk, dv = attention_backward(dout, q, k, v, out, tokens("lse", 2),
                                        causal="k" in reads)
        # the rows each writes: dq_buffer[:, :seqlen_q], dk_buffer[:, :seqlen_kv]
        return (put(of(writes, "dq_blk"), dq.split(C, 1))
                | put(of(writes, "dk_blk"), dk.split(C, 1))
                | put(of(writes, "dv_blk"), dv.split(C, 1)))
    if name == "init":  # dq = dq_buffer.to(float32), dk and dv likewise
        return (put(of(writes, "dq_acc"), read("dq_blk"))
                | put(of(writes, "dk_acc"), [chunks("dk_blk")])
                | put(of(writes, "dv_acc"), [chunks("dv_blk")]))
    if name.startswith("dq_"):  # dq += dq_buffer; the later-rank branch's
        # dq[:, C:] += dq_buffer[:, :C] is its declared dq_acc[1] and dq_blk[0]
        return add("dq_acc", read("dq_blk"))
    if name.startswith("dkv_"):  # the running dk/dv of the block in hand: the slot, or
        # its first chunk (dk[:, :block_seq_len] += dk_buffer[:, :block_seq_len])
        out = {}
        for acc, part in (("dk_acc", "dk_blk"), ("dv_acc", "dv_blk")):
            (at,) = running(acc, writes)
            assert running(acc, reads) == [at], name
            out[at] = bufs[at] + chunks(part)
        return out
    if name == "finish":
        (dk_home,), (dv_home,) = running("dk_acc", reads), running("dv_acc", reads)
        return (put(of(writes, "dq"), read("dq_acc"))
                | put(of(writes, "dk"), bufs[dk_home].unbind(1))
                | put(of(writes, "dv"), bufs[dv_home].unbind(1)))
    raise AssertionError(f"no engine step {name}")


def errors(path: Path, world: int) -> dict[str, float]:
    """Run the schedule at ``path`` (float64 reference, ``engine``) on causal attention over
    2W chunks, for each of B sequences; each rank's dq, dk, dv chunk -> its largest error
    relative to autograd's largest value there."""
    schedule = parse_file(path, world)
    gen = torch.Generator().manual_seed(world)
    n = 2 * world * C  # the whole sequence, 2W chunks of C tokens

    def bf16(*shape: int) -> torch.Tensor:  # drawn as the buffers store them
        return torch.randn(*shape, generator=gen, dtype=torch.float64).bfloat16().double()

    q, k, v, dout = bf16(B, n, H, D), bf16(B, n, HK, D), bf16(B, n, HK, D), bf16(B, n, H, D)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    group = H // HK
    s = torch.einsum("bqhd,bkhd->bhqk", qa, ka.repeat_interleave(group, 2)) * SCALE
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
    lse = torch.logsumexp(s, -1)  # [B, H, n]
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1),
                       va.repeat_interleave(group, 2))
    out.backward(dout)

    def chunk(t: torch.Tensor, j: int, dim: int = 1) -> torch.Tensor:
        return t.narrow(dim, j * C, C).detach()

    stored = {"q": (q, 1), "k": (k, 1), "v": (v, 1), "dout": (dout, 1),
              "out": (out.detach(), 1), "lse": (lse.detach(), 2)}
    inputs = []
    for r in range(world):  # rank r: chunks r and 2W - 1 - r
        mine = (r, 2 * world - 1 - r)
        bufs = {}
        for name, (t, dim) in stored.items():
            parts = [chunk(t, j, dim) for j in mine]
            if name not in schedule.buffers or name in schedule.slices:  # read by chunk
                bufs |= {f"{name}_{i}": simulate.as_stored(schedule, f"{name}_{i}", part)
                         for i, part in enumerate(parts)}
            if name in schedule.buffers:  # read whole: [B, 2, C, ...] ([B, H, 2, C])
                bufs[name] = simulate.as_stored(schedule, name, torch.stack(parts, dim))
        inputs.append(bufs)
    ends = simulate.simulate_call(schedule, world, {"B": B, "C": C, "H": H, "HK": HK, "D": D},
                                   inputs, engine)
    found = {}
    for r in range(world):
        for i, j in enumerate((r, 2 * world - 1 - r)):
            for name, grad in (("dq", qa.grad), ("dk", ka.grad), ("dv", va.grad)):
                want = chunk(grad, j)
                assert ends[r][f"{name}_{i}"].shape == want.shape == (B, C, want.shape[2], D)
                err = (ends[r][f"{name}_{i}"] - want).abs().max() / want.abs().max()
                found[f"{name}[:, {i}] (chunk {j}) on rank {r}"] = float(err)
    return found


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_backward_pass_gives_causal_attention_s_gradients(world: int) -> None:
    found = errors(FILE, world)
    assert len(found) == 6 * world
    # bf16 operands and results (dq_buffer, out, the outputs): seen up to 0.009
    assert max(found.values()) < 0.03, found


@pytest.mark.e2e
def test_dk_dv_sent_on_before_the_step_s_add_are_other_gradients(tmp_path: Path) -> None:
    """The ring's send of the running dk/dv (its credit and its puts) moved between the
    wait that lands the sum and the step's add: proved (a rank's program order is what it
    computes, no race; before the wait it is `read-before-write`), and `dcpc run` at W = 3
    finds nothing (the reference runs the same steps); these gradients do: the ring's
    steps pass on a sum without their own part (from W = 3: no step in the ring at
    W = 2)."""
    lines = FILE.read_text().splitlines(keepends=True)
    first = lines.index("        - dpost: {op: signal, to: prev, channel: dfree}\n")
    send = lines[first:first + 4]
    assert [line.split(":")[0].strip() for line in send] == [
        "- dpost", "- dcredit", "- dsend_k", "- dsend_v"]
    rest = lines[:first] + lines[first + 4:]
    add = rest.index("        - dkv_upper:\n")
    path = tmp_path / "zigzag_send_before_add.yaml"
    path.write_text("".join(rest[:add] + send + rest[add:]))
    assert pipeline.run(path, pipeline.Options(worlds=[2, 3, 4]), until="emit").module_text
    report = run_schedule(RunConfig(schedule=str(path), world=3, backend="host", calls=3))
    text = format_report(report)
    assert report.launch.ok and report.outputs, text
    assert report.mismatches == 0, text
    assert max(errors(path, 2).values()) < 0.03
    found = errors(path, 3)
    assert max(found[k] for k in found if k.startswith("dq")) < 0.03  # dq stays local
    assert max(found[k] for k in found if k.startswith(("dk", "dv"))) > 0.3, found
