"""Inputs and references for the GPU checks: deterministic cases and float64 merge math.

Every rank builds the same case from the same seed (all ranks' inputs), so each rank can
compute its own reference without any communication: a check costs no collective.
Masks follow shared/design/domain.md (interleave 1): an empty local shard or a CUDA-graph
padding row has weight 0, whatever garbage (NaN, +inf, huge LSE) its partial holds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

D, DV, KV_K = 576, 512, 576
MERGE_TOL = (1e-2, 1e-2)  # (atol, rtol) for a bf16 output merged in fp32
LSE_TOL = (1e-3, 1e-4)


@dataclass
class Ref:
    """What a written buffer must hold: bit-exact, or within tolerance of float64."""

    kind: str  # "exact" | "approx"
    value: torch.Tensor
    lse: torch.Tensor | None = None  # float64 LSE of the rows (approx: -inf rows must be 0)
    atol: float = MERGE_TOL[0]
    rtol: float = MERGE_TOL[1]


@dataclass
class DecodeCase:
    """One decode step of every rank: queries, attention partials, request layout."""

    T: int
    H: int
    W: int
    q: torch.Tensor  # [W, T, H/W, D] bf16: rank p's q_local is q[p]
    o: torch.Tensor  # [W, T, H, Dv] bf16: rank p's o_part
    lse: torch.Tensor  # [W, T, H] f32: rank p's lse_part
    seq_lens: torch.Tensor  # [B] int32
    qsl: torch.Tensor  # [B+1] int32 query_start_loc
    valid: torch.Tensor  # [W, T] bool: rank p's partial counts for row t


def random_layout(rnd: random.Random, T: int, B: int, W: int) -> tuple[list[int], list[int]]:
    """Request layout with empty shards and padding rows: (seq_lens [B], qsl [B+1])."""
    used = T if rnd.random() < 0.6 else rnd.randint(0, T)
    cuts = sorted(rnd.randint(0, used) for _ in range(B - 1))
    qsl = [0, *cuts, used]
    kinds = [0, 1, max(1, W - 1), rnd.randint(1, 4 * W), rnd.randint(W, 100_000)]
    seq_lens = [rnd.choice(kinds) for _ in range(B)]
    return seq_lens, qsl


def plain_layout(T: int, max_b: int = 256) -> tuple[list[int], list[int]]:
    """Benchmark layout: every row real, long contexts, B = min(T, max_b) equal requests."""
    B = min(T, max_b)
    step = T // B
    return [50_000] * B, [min(i * step, T) for i in range(B)] + [T]


def valid_mask(seq_lens: torch.Tensor, qsl: torch.Tensor, T: int, W: int,
               interleave: int = 1) -> torch.Tensor:
    """[W, T] bool: rank p's local KV for row t's request is non-empty and t is not padding."""
    rows = torch.arange(T, device=seq_lens.device, dtype=torch.int64)
    ends = qsl[1:].to(torch.int64).contiguous()
    req = torch.searchsorted(ends, rows, right=True)
    B = seq_lens.numel()
    real = (rows < qsl[-1].to(torch.int64)) & (req < B)
    sl = seq_lens.to(torch.int64)[req.clamp(max=B - 1)]
    base = sl // interleave // W * interleave
    p = torch.arange(W, device=seq_lens.device, dtype=torch.int64)[:, None]
    local = base + (sl - base * W - p * interleave).clamp(0, interleave)
    return (local > 0) & real[None, :]


def clean_lse(lse: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """float64 LSE with NaN/+inf and masked partials set to -inf. valid: [W, T]."""
    x = lse.double()
    bad = torch.isnan(x) | torch.isposinf(x) | ~valid.view(*valid.shape, *([1] * (x.dim() - 2)))
    return torch.where(bad, torch.full_like(x, float("-inf")), x)


def merge_ref(o: torch.Tensor, lse: torch.Tensor, valid: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 LSE-weighted merge over dim 0: o [W, T, h, Dv], lse [W, T, h] -> (out, LSE)."""
    lw = clean_lse(lse, valid)
    m = lw.amax(0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lw - m)
    s = w.sum(0)
    total = m + torch.log(s)  # -inf where every partial is masked
    wn = torch.where(s > 0, w / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(w))
    od = torch.where(wn[..., None] > 0, o.double(), torch.zeros((), dtype=torch.float64,
                                                                 device=o.device))
    return (wn[..., None] * od).sum(0), total


def corr_ref(o_r: torch.Tensor, lse: torch.Tensor, valid: torch.Tensor, rank: int
             ) -> torch.Tensor:
    """float64 ag_rs correction of rank's partial: exp(lse_r - LSE) * o_r, 0 where weight 0."""
    lw = clean_lse(lse, valid)
    m = lw.amax(0)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    total = m + torch.log(torch.exp(lw - m).sum(0))
    w = torch.where(torch.isneginf(lw[rank]), torch.zeros_like(total),
                    torch.exp(lw[rank] - torch.where(torch.isneginf(total),
                                                     torch.zeros_like(total), total)))
    od = torch.where(w[..., None] > 0, o_r.double(), torch.zeros((), dtype=torch.float64,
                                                                 device=o_r.device))
    return w[..., None] * od


def make_case(T: int, H: int, W: int, seed: int, device: torch.device, B: int | None = None,
              layout: tuple[Any, Any] | None = None, garbage: bool = True) -> DecodeCase:
    """A decode case, identical on every rank for the same seed; masked partials hold garbage.

    ``layout`` is (seq_lens, query_start_loc) as lists or int32 device tensors (tensors
    avoid host-to-device copies inside a replay loop).
    """
    rnd = random.Random(seed)
    if layout is None:
        layout = random_layout(rnd, T, B or max(1, min(T, rnd.randint(1, 6))), W)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    hl = H // W
    q = torch.randn(W, T, hl, D, generator=gen, device=device).to(torch.bfloat16)
    o = torch.randn(W, T, H, DV, generator=gen, device=device).to(torch.bfloat16)
    lse = torch.randn(W, T, H, generator=gen, device=device) * 3.0 + 2.0
    seq_lens, qsl = (x if isinstance(x, torch.Tensor)
                     else torch.tensor(x, dtype=torch.int32, device=device) for x in layout)
    valid = valid_mask(seq_lens, qsl, T, W)
    if garbage:
        dead = ~valid[:, :, None].expand(W, T, H)
        pick = torch.rand(W, T, H, generator=gen, device=device)
        junk = torch.where(pick < 0.5, torch.full_like(lse, float("nan")),
                           torch.full_like(lse, 80.0))
        junk = torch.where(pick > 0.9, torch.full_like(lse, float("inf")), junk)
        lse = torch.where(dead, junk, lse)
        # a few live partials with weight 0 (LSE -inf or NaN) and garbage output
        zero_w = (~dead) & (pick < 0.03)
        lse = torch.where(zero_w & (pick < 0.015), torch.full_like(lse, float("-inf")), lse)
        lse = torch.where(zero_w & (pick >= 0.015), torch.full_like(lse, float("nan")), lse)
        o = torch.where((dead | zero_w)[..., None], torch.full_like(o, float("nan")), o)
    return DecodeCase(T, H, W, q, o, lse.float().contiguous(), seq_lens, qsl, valid)


def case_inputs(case: DecodeCase, rank: int) -> dict[str, torch.Tensor]:
    """The engine-owned buffers of one rank, by schedule buffer name (copies: a view
    would keep every rank's partials alive, W times what this rank needs)."""
    return {"q_local": case.q[rank].clone(), "o_part": case.o[rank].clone(),
            "lse_part": case.lse[rank].clone(), "seq_lens": case.seq_lens,
            "query_start_loc": case.qsl}


def case_refs(case: DecodeCase, rank: int, schedule: str = "") -> dict[str, Ref]:
    """What every buffer a decode schedule writes must hold on ``rank`` (only the
    buffers ``schedule`` writes when it is one of benchmarks.support.modules.STEPS; each
    its own copy, so that a pool of cases does not keep whole cases alive: at W=8,
    H=128, T=512 a case is 0.6 GB, and views of it ran one H200 out of memory in DBO)."""
    from benchmarks.support.steps import STEPS

    T, H, W = case.T, case.H, case.W
    hl = H // W
    heads = slice(rank * hl, (rank + 1) * hl)
    tol = (0.03 * max(1, W // 2), 0.02) if schedule.endswith("ag_rs") else MERGE_TOL

    def q_full() -> torch.Tensor:
        return case.q.permute(1, 0, 2, 3).reshape(T, H, D).clone()

    def merged() -> tuple[torch.Tensor, torch.Tensor]:
        if "merged" not in cache:
            cache["merged"] = merge_ref(case.o[:, :, heads], case.lse[:, :, heads], case.valid)
        return cache["merged"]

    cache: dict[str, Any] = {}
    make = {
        "q_full": lambda: Ref("exact", q_full()), "q_stage": lambda: Ref("exact", q_full()),
        "o_recv": lambda: Ref("exact", case.o[:, :, heads].clone()),
        "lse_recv": lambda: Ref("exact", case.lse[:, :, heads].clone()),
        "lse_all": lambda: Ref("exact", case.lse.clone()),
        "o_corr": lambda: Ref("approx", corr_ref(case.o[rank], case.lse, case.valid, rank)),
        "out": lambda: Ref("approx", merged()[0], merged()[1], atol=tol[0], rtol=tol[1]),
        "out_lse": lambda: Ref("lse", merged()[1]),
    }
    wanted = ({name for _, outs in STEPS[schedule] for name in outs} if schedule in STEPS
              else set(make))
    return {name: fn() for name, fn in make.items() if name in wanted}


def kv_case(n_rows: int, W: int, seed: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv of every rank [W, N, K] bf16, gathered reference [W*N, K]: row j*W + p = kv[p][j])."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    kv = torch.randn(W, n_rows, KV_K, generator=gen, device=device).to(torch.bfloat16)
    return kv, kv.transpose(0, 1).reshape(W * n_rows, KV_K)


def bad_count(got: torch.Tensor, ref: Ref) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of wrong elements, max abs error) as device scalars: no host sync."""
    if tuple(got.shape) != tuple(ref.value.shape):
        raise ValueError(f"shape {tuple(got.shape)} != expected {tuple(ref.value.shape)}")
    if ref.kind == "exact":
        same = _bits(got) == _bits(ref.value)
        if got.is_floating_point():
            same |= torch.isnan(got) & torch.isnan(ref.value)
        return (~same).sum(), torch.zeros((), device=got.device, dtype=torch.float64)
    g = got.double()
    r = ref.value
    if ref.kind == "lse":
        dead = torch.isneginf(r)
        err = torch.where(dead, torch.zeros_like(g), (g - r).abs())
        ok = torch.where(dead, torch.isneginf(g), err <= LSE_TOL[0] + LSE_TOL[1] * r.abs())
        return (~ok).sum(), torch.nan_to_num(err, nan=float("inf")).max()
    err = (g - r).abs()
    ok = torch.isfinite(g) & (err <= ref.atol + ref.rtol * r.abs())
    if ref.lse is not None:  # rows with no live partial must be exactly 0
        dead = torch.isneginf(ref.lse)[..., None]
        ok = torch.where(dead, g == 0, ok)
    return (~ok).sum(), torch.nan_to_num(err, nan=float("inf")).max()


def _bits(x: torch.Tensor) -> torch.Tensor:
    size = x.element_size()
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                8: torch.int64}[size])
