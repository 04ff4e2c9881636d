"""all_reduce (sum, max): every stage, from the verifier to runs on both CPU backends
against float64, the checker against the brute force, and the same bits on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import script_env
from support.hb_oracle import oracle_keys
from support.kernels import run_ranks
from support.schedules import errors, write

from dcpc import pipeline
from dcpc.check import hb
from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.parse import parse_text

SCHEDULE = """\
schedule: ar
sizes:
  T: {max: 8}
  H: 4
  D: 16
buffers:
  x:    {shape: [T, H, D], dtype: bf16}
  y:    {shape: [T, H, D], dtype: f32}
steps:
  - make:    {op: external, writes: [x]}
  - reduce:  {op: all_reduce, src: x, dst: y, reduce: sum}
  - use:     {op: external, reads: [y]}
  - release: {op: barrier}
"""
VIA = SCHEDULE.replace("reduce: sum}", "reduce: sum, via: recv}").replace(
    "steps:", "  recv: {shape: [W, T, H, D], dtype: bf16, symmetric: true}\nsteps:")


@pytest.mark.parametrize("text", [SCHEDULE, VIA], ids=["implicit", "via"])
def test_checks_clean_and_the_brute_force_agrees(tmp_path: Path, text: str) -> None:
    c = pipeline.run(write(tmp_path, text, "ar.yaml"), pipeline.Options(worlds=(2, 3, 4)))
    (step,) = [s for s in c.plan.steps if s.name == "reduce"]
    assert step.sync.signal == "all" and step.sync.wait == "all"
    for world in (2, 3):
        assert oracle_keys(c.schedule, world) == set()
        assert hb.check(c.schedule, [world]).findings == []


@pytest.mark.parametrize("text,buffer", [(SCHEDULE, "reduce_recv"), (VIA, "recv")],
                         ids=["implicit", "via"])
def test_the_next_call_overwrites_via_without_the_barrier(text: str, buffer: str) -> None:
    """A peer's next call pushes into via while this rank still reduces it: the checker
    and the independent brute force both say write-after-read."""
    schedule = parse_text(text.replace("  - release: {op: barrier}\n", ""), "ar.yaml")
    want = {("race", "write-after-read", buffer, "reduce", "reduce")}
    for world in (2, 3):
        assert oracle_keys(schedule, world) == want
        assert {f.key for f in hb.check(schedule, [world], hints=False).findings} == want


def test_refusals_name_the_buffer_and_where(tmp_path: Path) -> None:
    text = SCHEDULE.replace("x:    {shape: [T, H, D], dtype: bf16}",
                            "x:    {shape: [T, H, D], dtype: i32}")
    found = errors(write(tmp_path, text, "ar.yaml"))
    assert [(c, line, col) for c, line, col, _ in found] == [("non-float-output", 11, 36)]
    assert "src 'x' of all_reduce 'reduce' is i32" in found[0][3]
    text = VIA.replace("[W, T, H, D], dtype: bf16, symmetric: true",
                       "[T, H, D], dtype: bf16, symmetric: true")
    found = errors(write(tmp_path, text, "ar.yaml"))
    assert [(c, line) for c, line, _, _ in found] == [("shape-mismatch", 12)]
    assert "has 3 dims [T, H, D] but must have 4, [W, T, H, D]" in found[0][3]
    text = VIA.replace("dtype: bf16, symmetric: true}", "dtype: bf16}")
    assert [c for c, *_ in errors(write(tmp_path, text, "ar.yaml"))] == ["not-symmetric"]
    text = SCHEDULE.replace("dst: y,", "dst: x,")
    assert "aliased-buffer" in [c for c, *_ in errors(write(tmp_path, text, "ar.yaml"))]


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_the_reference_reduces_every_rank(reduce: str) -> None:
    schedule = parse_text(SCHEDULE.replace("reduce: sum", f"reduce: {reduce}"), "ar.yaml")
    world, gen = 3, torch.Generator().manual_seed(7)
    inputs = [{"x": simulate.as_stored(schedule, "x", torch.randn(
        5, 4, 16, generator=gen, dtype=torch.float64))} for _ in range(world)]
    out = simulate.simulate_call(schedule, world, {"T": 5, "H": 4, "D": 16}, inputs,
                                 lambda *_: {})
    stacked = torch.stack([inputs[p]["x"] for p in range(world)])
    want = stacked.sum(0) if reduce == "sum" else stacked.amax(0)
    for rank in range(world):
        assert torch.equal(out[rank]["y"], want)


@pytest.mark.e2e
@pytest.mark.parametrize("world,backend,reduce,text", [  # host: the tree_attention gallery
    (3, "torch", "sum", VIA)])
def test_dcpc_run_matches_float64(tmp_path: Path, world: int, backend: str, reduce: str,
                                  text: str) -> None:
    path = write(tmp_path, text.replace("reduce: sum", f"reduce: {reduce}"), "ar.yaml")
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend=backend,
                                    calls=4, seed=11 + world))
    out = format_report(report)
    assert report.launch.ok and report.mismatches == 0, out
    assert report.outputs["y"].compared == 4 * world, out


# reduce: lse (tree attention / PCP): every rank gets the merged output and LSE
LSE = """\
schedule: tree
sizes:
  T: {max: 8}
  B: {max: 4}
  H: 4
  Dv: 16
buffers:
  o:        {shape: [T, H, Dv], dtype: bf16}
  lse:      {shape: [T, H], dtype: f32, lse_base: e}
  o_recv:   {shape: [W, T, H, Dv], dtype: bf16, symmetric: true}
  lse_recv: {shape: [W, T, H], dtype: f32, symmetric: true, lse_base: e}
  out:      {shape: [T, H, Dv], dtype: bf16}
  out_lse:  {shape: [T, H], dtype: f32, lse_base: e}
  seq_lens: {shape: [B], dtype: i32}
  query_start_loc: {shape: [B+1], dtype: i32}
steps:
  - attention: {op: external, reads: [seq_lens, query_start_loc], writes: [o, lse]}
  - merge:     {op: all_reduce, reduce: lse, src: [o, lse], via: [o_recv, lse_recv],
                dst: out, return_lse: out_lse,
                mask_empty: {seq_lens: seq_lens, query_start_loc: query_start_loc}}
  - release:   {op: barrier}
"""


def test_lse_checks_clean_and_races_without_the_barrier() -> None:
    schedule = parse_text(LSE, "tree.yaml")
    for world in (2, 3):
        assert oracle_keys(schedule, world) == set()
        assert hb.check(schedule, [world]).findings == []
    racy = parse_text(LSE.replace("  - release:   {op: barrier}\n", ""), "tree.yaml")
    want = {("race", "write-after-read", b, "merge", "merge") for b in ("o_recv", "lse_recv")}
    for world in (2, 3):
        assert oracle_keys(racy, world) == want
        assert {f.key for f in hb.check(racy, [world], hints=False).findings} == want


@pytest.mark.parametrize("old,new,code,words", [
    ("via: [o_recv, lse_recv],", "", "bad-reduce", "needs 'src: [o, lse]' and 'via: [o_recv"),
    ("o_recv:   {shape: [W, T, H, Dv]", "o_recv:   {shape: [T, H, Dv]", "shape-mismatch",
     "via 'o_recv' of step 'merge' has 3 dims"),
    ("lse_recv: {shape: [W, T, H], dtype: f32, symmetric: true, lse_base: e}",
     "lse_recv: {shape: [W, T, H], dtype: f32, symmetric: true, lse_base: 2}",
     "lse-base-mismatch", "moves an LSE of base e from 'lse' into 'lse_recv'"),
    ("reduce: lse, src: [o, lse]", "reduce: sum, src: [o, lse]", "bad-reduce",
     "with reduce: sum takes one buffer as src"),
])
def test_lse_refusals(tmp_path: Path, old: str, new: str, code: str, words: str) -> None:
    assert old in LSE
    found = errors(write(tmp_path, LSE.replace(old, new, 1), "ar.yaml"))
    assert any(c == code and words in msg for c, _, _, msg in found), found


def test_lse_reference_is_the_merge_of_every_rank() -> None:
    """float64: every rank's out is lse_combine's merge of all W partials, with an
    empty shard's partial (garbage output, lse forced to -inf) weighing nothing."""
    from dcpc.runtime import merge

    schedule = parse_text(LSE, "tree.yaml")
    world, gen = 3, torch.Generator().manual_seed(5)
    lens = torch.tensor([1, 7], dtype=torch.int32)  # request 0: only rank 0 holds a token
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)  # rows 4, 5: padding
    inputs = []
    for _ in range(world):
        o = torch.randn(6, 4, 16, generator=gen, dtype=torch.float64)
        lse = torch.randn(6, 4, generator=gen, dtype=torch.float64)
        inputs.append({"o": simulate.as_stored(schedule, "o", o), "lse": lse.float().double(),
                       "seq_lens": lens, "query_start_loc": qsl})
    inputs[2]["o"][0] = float("nan")  # an empty shard's garbage
    out = simulate.simulate_call(schedule, world, {"T": 6, "B": 2, "H": 4, "Dv": 16}, inputs,
                                 lambda *_: {})
    stacked_o = torch.stack([inputs[p]["o"] for p in range(world)])
    stacked_lse = torch.stack([inputs[p]["lse"] for p in range(world)])
    masked = merge.empty_mask(lens, qsl, 6, world, 1)
    want, want_lse = merge.lse_combine(stacked_o, stacked_lse, "e", masked)
    for rank in range(world):
        assert not out[rank]["out"][:4].isnan().any()
        torch.testing.assert_close(out[rank]["out"], simulate.as_stored(schedule, "out", want))
        torch.testing.assert_close(out[rank]["out_lse"], want_lse.double(), rtol=1e-6,
                                   atol=1e-6)


@pytest.mark.e2e
@pytest.mark.parametrize("world,backend", [(2, "host"), (2, "torch")])
def test_lse_run_matches_float64(tmp_path: Path, world: int, backend: str) -> None:
    report = run_schedule(RunConfig(schedule=str(write(tmp_path, LSE, "ar.yaml")), world=world,
                                    backend=backend, calls=4, seed=21 + world))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    for name in ("out", "out_lse"):
        assert report.outputs[name].compared == 4 * world, text


@pytest.mark.e2e
def test_every_rank_gets_the_same_bits(tmp_path: Path) -> None:
    """Ranks as threads (local backend): bf16 inputs of mixed magnitudes, summed in fp32
    in rank order, give bitwise equal outputs on every rank, equal to that order's sum."""
    path = write(tmp_path, SCHEDULE, "ar.yaml")
    module = tmp_path / "ar.py"
    module.write_text(pipeline.run(path, pipeline.Options(worlds=(3,))).module_text)
    env = script_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, str(module)], capture_output=True,
                          text=True, timeout=300, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == {"equal_across_ranks": True, "equal_to_rank_order": True,
                      "differs_from_reverse_order": True}


def _bits_child(module_path: str) -> None:
    from dcpc.runtime.loading import import_file, schedule_class

    world = 3
    cls = schedule_class(import_file(Path(module_path), "dcpc_generated_ar"), "ar")
    gen = torch.Generator().manual_seed(3)
    # magnitudes 1e-3 .. 1e3: fp32 addition is not associative on these
    xs = [(torch.randn(8, 4, 16, generator=gen) * 10.0 ** torch.randint(
        -3, 4, (8, 4, 16), generator=gen)).to(torch.bfloat16) for _ in range(world)]
    outs: list[torch.Tensor] = [torch.empty(0)] * world

    def body(rank) -> None:  # noqa: ANN001
        mod = cls(rank, sizes={"T": 8}, device="cpu", backend="local")
        outs[rank.rank] = mod.reduce(xs[rank.rank]).clone()
        rank.barrier()
        mod.close()

    run_ranks(world, body)
    ordered = xs[0].float()
    for p in range(1, world):
        ordered = ordered + xs[p].float()
    reverse = xs[world - 1].float()
    for p in range(world - 2, -1, -1):
        reverse = reverse + xs[p].float()
    print("RESULT " + json.dumps({
        "equal_across_ranks": all(torch.equal(outs[0], o) for o in outs),
        "equal_to_rank_order": torch.equal(outs[0], ordered),
        "differs_from_reverse_order": not torch.equal(outs[0], reverse)}))


if __name__ == "__main__":
    _bits_child(sys.argv[1])
