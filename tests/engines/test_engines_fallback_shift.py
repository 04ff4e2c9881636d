"""The adapters' torch fallback merges like the kernels: invariant to a common shift of
every partial's LSE (issue 22 item 7; the fallback drifted 2.3% at 1e6, 35% at 1e7 when
its weights were exp(lse_p - G) with G rounded to ulp(G)).

The partials' LSE differences are whole numbers, exact in fp32 at every shift, so the
float64 reference of the unshifted inputs is the answer at every shift (what float32 can
reach is explained in tests/runtime/test_merge_shift.py)."""

from __future__ import annotations

import pytest
import torch

from dcpc.engines.fallback import a2a_merge, correct

SHIFTS = [0.0, 1e3, -1e3, 1e6, -1e6, 1e7, -1e7]
WORLD, TOKENS, HEADS, DV = 3, 5, 4, 16


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(WORLD, TOKENS, HEADS, DV, generator=g, dtype=torch.float64)
    lse = torch.randint(-6, 7, (WORLD, TOKENS, HEADS), generator=g).double()
    lse[1, 0, :] = float("-inf")  # an empty shard
    o[1, 0, :, :] = float("nan")  # whose partial output is garbage
    return o, lse


def _reference(o: torch.Tensor, lse: torch.Tensor, base2: bool) -> torch.Tensor:
    nat = lse * torch.log(torch.tensor(2.0, dtype=torch.float64)) if base2 else lse
    w = torch.softmax(nat, dim=0).unsqueeze(-1)
    return torch.where(w == 0, 0.0, w * o).sum(0)


@pytest.mark.parametrize("base2", [False, True], ids=["base_e", "base_2"])
@pytest.mark.parametrize("shift", SHIFTS)
def test_a2a_merge_is_shift_invariant(shift: float, base2: bool) -> None:
    o, lse = _inputs(7)
    out, total = a2a_merge(o.float(), (lse + shift).float(), base2)
    want = _reference(o, lse, base2)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(total).all()


@pytest.mark.parametrize("base2", [False, True], ids=["base_e", "base_2"])
@pytest.mark.parametrize("shift", SHIFTS)
def test_correct_sums_to_the_merge_at_any_shift(shift: float, base2: bool) -> None:
    o, lse = _inputs(11)
    parts = [correct(o[r].float(), (lse + shift).float(), r, base2)[0] for r in range(WORLD)]
    got = torch.stack(parts).sum(0)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.double(), _reference(o, lse, base2), rtol=1e-5, atol=1e-5)
