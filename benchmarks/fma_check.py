"""Does weighted_combine round each term once (an FFMA, as DeepEP's decode_and_accumulate)?

    python3 -m benchmarks.fma_check [--device cuda] [--tokens 64] [--topk 8] [--hidden 4096]
        [--seeds 3] [--out DIR]
    TRITON_INTERPRET=1 python3 -m benchmarks.fma_check --device cpu --tokens 4 --hidden 64

Compiles a one-step schedule (weighted_combine, x/weights/dst f32, an i32 index) for W = 2,
runs it through the ``local`` backend (two ranks as threads; the step is local to a rank)
on random inputs, and compares the kernel's fp32 output bit for bit with two references
computed here, term by term in k order from +0:
  - fused:   acc = fl32(w * x + acc), the product and the sum in float64, rounded once
             (float64 holds w * x exactly; the sum rounds twice only where it needs more
             than 53 bits and lands on an fp32 midpoint: not seen at these sizes);
  - unfused: acc = acc + fl32(w * x), two roundings (what ``acc += w * v`` is unless the
             compiler contracts it).
On the GPU the kernel's tl.fma is one FFMA: every element equals ``fused``. Triton's CPU
interpreter computes tl.fma as a numpy product and sum: there it equals ``unfused``. Prints
one JSON object (also DIR/fma_check.json with --out): per seed the elements equal to each
reference, and ``verdict``: "fused", "unfused" or "neither" (the last: a bug).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

SCHEDULE = """\
schedule: fma
sizes: {{T: {t}, K: {k}, R: {r}, H: {h}}}
buffers:
  x:   {{shape: [R, H], dtype: f32}}
  w:   {{shape: [T, K], dtype: f32}}
  idx: {{shape: [T, K], dtype: i32}}
  out: {{shape: [T, H], dtype: f32}}
steps:
  - combine: {{op: weighted_combine, src: [x, w], dst: out, index: idx}}
"""


def inputs(seed: int, tokens: int, topk: int, rows: int, hidden: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows and weights over several binades, so products carry bits fp32 drops."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, dtype=torch.float64)
    x = (x * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=g))).float()
    w = torch.rand(tokens, topk, generator=g, dtype=torch.float64).float()
    idx = torch.randint(0, rows, (tokens, topk), generator=g, dtype=torch.int32)
    return x, w, idx


def references(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    fused = torch.zeros(w.shape[0], x.shape[1], dtype=torch.float32)
    unfused = torch.zeros_like(fused)
    for k in range(w.shape[1]):
        row = x[idx[:, k].long()]
        wk = w[:, k, None]
        fused = (wk.double() * row.double() + fused.double()).float()
        unfused = unfused + wk * row
    return fused, unfused


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.local import LocalGroup

    rows = 2 * args.tokens
    text = SCHEDULE.format(t=args.tokens, k=args.topk, r=rows, h=args.hidden)
    cases = [inputs(s, args.tokens, args.topk, rows, args.hidden) for s in range(args.seeds)]

    def rank_main(rank: Any, path: str) -> list[dict[str, Any]]:
        module = load_module_class(path, "fma")(rank, device=args.device, backend="local",
                                                timeout_s=60)
        seen = []
        for seed, (x, w, idx) in enumerate(cases):
            got = module.combine(x.to(args.device), w.to(args.device), idx.to(args.device))
            got = got.cpu().view(torch.int32)
            fused, unfused = (r.view(torch.int32) for r in references(x, w, idx))
            n_fused = int((got == fused).sum())
            n_unfused = int((got == unfused).sum())
            total = got.numel()
            verdict = ("fused" if n_fused == total else "unfused" if n_unfused == total
                       else "neither")
            seen.append({"seed": seed, "rank": rank.rank, "elements": total,
                         "equal_fused": n_fused, "equal_unfused": n_unfused,
                         "references_differ": int((fused != unfused).sum()),
                         "verdict": verdict})
        module.close()
        return seen

    with tempfile.TemporaryDirectory(prefix="dcpc-fma-") as tmp:
        src = Path(tmp) / "fma.yaml"
        src.write_text(text)
        _, module_path, _, _ = compile_to(str(src), Path(tmp), 2)
        per_rank = LocalGroup(2, args.device, timeout_s=600).run(rank_main, module_path)
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "commit": os.environ.get("COMMIT", ""),
        "sizes": {"tokens": args.tokens, "topk": args.topk, "hidden": args.hidden},
        "runs": [run for rank in per_rank for run in rank],
    }
    verdicts = {run["verdict"] for run in report["runs"]}
    report["verdict"] = verdicts.pop() if len(verdicts) == 1 else "mixed"
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fma_check.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
