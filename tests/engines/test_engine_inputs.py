"""What engines pass, through the generated kernels (Triton interpreter, ranks as threads of
one process: the ``local`` backend on CPU), against float64:

- strided inputs: a head-strided query, an attention output sliced out of a padded
  buffer, an LSE transposed from [H, T]; each call's result must equal, bit for bit, the
  same call with contiguous copies, and the float64 merge;
- the ag_rs path keeps its correction in fp32 through the reduce-scatter: its error is no
  larger than the a2a path's on the same inputs (measured on 2 x 3 calls);
- the language's checks of ``local_seq_lens``, ``output_scale`` and a mixed-dtype
  reduce_scatter (the kernels of those run in tests/runtime/test_e2e_schedules.py's
  engine-input schedules).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import script_env

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ("kimi_k3_dcp", "kimi_k3_dcp_fused", "kimi_k3_dcp_ag_rs")
T, B, CALLS = 6, 3, 2

pytestmark = pytest.mark.e2e


def _inputs(rank: int, world: int, heads: int, d: int, dv: int, call: int) -> dict[str, Any]:
    """One rank's engine tensors, strided as engines hand them over (random, with NaN
    garbage in empty shards and padding rows, which the merge must mask)."""
    import torch

    from dcpc.runtime import merge

    g = torch.Generator().manual_seed(1000 * call + 17 * rank + world)
    hl = heads // world
    q_big = torch.randn(T, hl + 1, d + 8, generator=g).bfloat16()
    o_big = torch.randn(T, heads + 2, dv + 16, generator=g).bfloat16()
    lse_ht = torch.randn(heads, T, generator=g) * 3  # [H, T], as FlashAttention returns it
    g2 = torch.Generator().manual_seed(call)  # the request layout: the same on every rank
    seq_lens = torch.randint(1, 2 * world, (B,), generator=g2, dtype=torch.int32)
    seq_lens[0] = 1  # ranks 1.. hold no KV of request 0
    qsl = torch.tensor([0, 2, 3, 5], dtype=torch.int32)  # tokens 5.. are padding
    empty = merge.empty_mask(seq_lens, qsl, T, world, 1)[rank]
    o = o_big[:, 1 : heads + 1, :dv]
    o[empty] = float("nan")
    lse_ht[:, empty] = float("nan")
    return {
        "q_local": q_big[:, 1:, 4 : 4 + d],
        "o_part": o,
        "lse_part": lse_ht.t(),
        "seq_lens": seq_lens,
        "query_start_loc": qsl,
    }


def _call(module: Any, env: dict[str, Any], slot: int) -> dict[str, Any]:
    """Every generated method of the schedule, in step order, on ``env``'s tensors."""
    out: dict[str, Any] = {}
    for step in module.STEPS:
        if step not in module.METHODS:
            continue  # an external step: the engine's attention (inputs are given)
        result = getattr(module, step)(*[env[n] for n in module.METHODS[step]], slot=slot)
        values = result if isinstance(result, tuple) else (result,)
        out[step] = [v.clone() for v in values]
    return out


def _rank_main(rank: Any, path: str, world: int) -> dict[str, Any]:
    import torch

    from dcpc.harness.worker import load_module_class
    from dcpc.runtime import merge

    name = Path(path).stem
    cls = load_module_class(path, name)
    heads = 2 * world
    d, dv = cls.SIZES["D"][1], cls.SIZES["Dv"][1]
    module = cls(rank, sizes={"H": heads, "T": T, "B": B}, device="cpu", backend="local",
                 poison=True)
    r, hl = rank.rank, heads // world
    report: dict[str, Any] = {"exact": True, "gather_exact": True, "nan": False, "err": 0.0}
    for call in range(CALLS):
        ranks = [_inputs(p, world, heads, d, dv, call) for p in range(world)]
        strided = _call(module, ranks[r], slot=0)
        packed = _call(module, {k: v.contiguous() for k, v in ranks[r].items()}, slot=1)
        for step, values in strided.items():
            for a, b in zip(values, packed[step], strict=True):
                same = torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())
                report["exact"] &= same
        q_ref = torch.cat([x["q_local"] for x in ranks], dim=1)
        report["gather_exact"] &= torch.equal(strided["query_gather"][0], q_ref)
        final = strided[module.STEPS[-1]][0]  # the merged output [T, H/W, Dv]
        heads_r = slice(r * hl, (r + 1) * hl)
        o64 = torch.stack([x["o_part"][:, heads_r] for x in ranks]).double()
        lse64 = torch.stack([x["lse_part"][:, heads_r] for x in ranks]).double()
        masked = merge.empty_mask(ranks[0]["seq_lens"], ranks[0]["query_start_loc"], T,
                                  world, 1)
        ref, _ = merge.lse_combine(o64, lse64, "e", masked, torch.float64)
        report["nan"] |= bool(final.isnan().any())
        report["err"] = max(report["err"], float((final.double() - ref).abs().max()))
    rank.barrier()
    module.close()
    return report


def _child(world: int) -> None:
    import tempfile
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    from dcpc.harness.run import compile_to
    from dcpc.runtime.local import LocalGroup

    out = {}
    with tempfile.TemporaryDirectory(prefix="dcpc-inputs-") as tmp:
        for name in SCHEDULES:
            _, module, _, _ = compile_to(str(ROOT / "schedules" / f"{name}.yaml"), Path(tmp),
                                         world)
            group = LocalGroup(world, "cpu", timeout_s=240)
            out[name] = group.run(_rank_main, module, world)
    print("RESULT " + json.dumps(out))


def _run_child(world: int) -> dict[str, list[dict[str, Any]]]:
    env = script_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, str(world)], capture_output=True,
                          text=True, timeout=600, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("world", [2, 3])
def test_strided_inputs_match_contiguous_and_float64(world: int) -> None:
    results = _run_child(world)
    errors = {}
    for name, ranks in results.items():
        assert len(ranks) == world
        for r, rep in enumerate(ranks):
            where = f"{name} W={world} rank {r}"
            assert rep["gather_exact"], f"{where}: the strided query's gather is not exact"
            assert rep["exact"], f"{where}: strided inputs give other bits than contiguous"
            assert not rep["nan"], f"{where}: NaN in the merged output"
            assert rep["err"] < 0.05, f"{where}: merged output off float64 by {rep['err']}"
        errors[name] = max(rep["err"] for rep in ranks)
    # fp32 through the reduce-scatter: one bf16 rounding, as the a2a merge
    assert errors["kimi_k3_dcp_ag_rs"] <= errors["kimi_k3_dcp"], errors


def _check(text: str, tmp: Path) -> list[str]:
    """The codes ``dcpc check`` reports for a schedule (empty: accepted); what it
    accepts must compile too."""
    from dcpc.diagnostics import DiagnosticError
    from dcpc.pipeline import Options, run

    path = tmp / "x.yaml"
    path.write_text(text)
    try:
        run(path, Options(worlds=(2, 3)), until="emit")
    except DiagnosticError as err:
        return sorted({d.code for d in err.diagnostics})
    return []


MERGE = """\
schedule: m
sizes: {{T: {{max: 8}}, B: {{max: 4}}, H: {{multiple_of: W}}}}
buffers:
  o:     {{shape: [W, T, H, 16], dtype: bf16, symmetric: true}}
  lse:   {{shape: [W, T, H], dtype: f32, symmetric: true, lse_base: e}}
  out:   {{shape: [T, H, 16], dtype: {out}}}
{scale}  lens:  {{shape: {lens_shape}, dtype: i32}}
  qsl:   {{shape: [B+1], dtype: i32}}
steps:
  - fill:  {{op: external, writes: [o, lse]}}
  - sync:  {{op: barrier}}
  - merge: {{op: lse_combine, src: [o, lse], dst: out{extra},
            mask_empty: {{{lens_key}: lens, query_start_loc: qsl}}}}
  - done:  {{op: barrier}}
"""


def _merge_text(out: str, extra: str, scale_shape: str, lens_key: str, lens_shape: str) -> str:
    scale = f"  scale: {{shape: {scale_shape}, dtype: f32}}\n" if extra else ""
    return MERGE.format(out=out, extra=extra, scale=scale, lens_key=lens_key,
                        lens_shape=lens_shape)


@pytest.mark.parametrize(
    "out,extra,scale_shape,lens_key,lens_shape,codes",
    [
        ("bf16", "", "[1]", "local_seq_lens", "[B, W]", []),
        ("fp8e4m3", ", output_scale: scale", "[1]", "seq_lens", "[B]", []),
        ("fp8e4m3", "", "[1]", "seq_lens", "[B]", ["missing-output-scale"]),
        ("bf16", ", output_scale: scale", "[1]", "seq_lens", "[B]", ["bad-output-scale"]),
        ("fp8e4m3", ", output_scale: scale", "[2]", "seq_lens", "[B]", ["bad-output-scale"]),
        ("bf16", "", "[1]", "local_seq_lens", "[B]", ["bad-mask"]),
        ("bf16", "", "[1]", "local_seq_lens", "[B, 2]", ["shape-mismatch"]),
    ],
)
def test_checks_of_engine_inputs(tmp_path, out, extra, scale_shape, lens_key, lens_shape,
                                 codes) -> None:
    text = _merge_text(out, extra, scale_shape, lens_key, lens_shape)
    assert _check(text, tmp_path) == codes


def test_mask_needs_exactly_one_kind_of_lengths(tmp_path) -> None:
    text = _merge_text("bf16", "", "[1]", "seq_lens", "[B]")
    text = text.replace("seq_lens: lens,", "seq_lens: lens, local_seq_lens: lens,")
    assert _check(text, tmp_path), "both seq_lens and local_seq_lens must be refused"


@pytest.mark.parametrize("src,dst,ok", [("f32", "bf16", True), ("bf16", "f32", True),
                                        ("i32", "f32", False)])
def test_reduce_scatter_rounds_once_into_a_narrower_dtype(tmp_path, src: str, dst: str,
                                                          ok: bool) -> None:
    text = f"""\
schedule: rs
sizes: {{T: {{max: 8}}, H: {{multiple_of: W}}}}
buffers:
  x:   {{shape: [T, H, 16], dtype: {src}}}
  out: {{shape: [T, H/W, 16], dtype: {dst}}}
steps:
  - make:    {{op: external, writes: [x]}}
  - scatter: {{op: reduce_scatter, src: x, dst: out, dim: 1}}
  - done:    {{op: barrier}}
"""
    assert (_check(text, tmp_path) == []) == ok


if __name__ == "__main__":
    _child(int(sys.argv[1]))
