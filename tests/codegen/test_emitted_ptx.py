"""The emitted kernels as the GPU runs them: compiled for sm_90 on this CPU-only machine
(dcpc.harness.ptx) and read for what the interpreter cannot show: a signal released
before a block barrier orders the other threads' stores, a data load after a wait with no
block barrier, an approximate division where the reference divides in IEEE arithmetic,
fp8 bytes moved through shared memory in byte pairs (wrong bytes on an H100).

Every shipped, gallery and per-op schedule is clean; a missing barrier before a release
and an approximate division are found when put back into an emitted module (the
mutations below): the CPU suite fails on them. (The barrier after a wait cannot go
missing this way: Triton 3.6 broadcasts a vector atomic's result through shared memory
with a bar.sync, so every acquire of the spin is followed by one; the reader still
checks it.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpc.harness.ptx import capture_schedules, check_ptx, check_schedules
from dcpc.lang.mesh import MeshWorld

ROOT = Path(__file__).resolve().parents[2]
FILES = [p for folder in ("schedules", "schedules/gallery", "schedules/ops")
         for p in sorted((ROOT / folder).glob("*.yaml"))]
RELEASE_BARRIER = ("tl.debug_barrier()  # Triton 3.6 does not order the block's stores "
                   "before a release")


def _world(path: Path) -> int | MeshWorld:
    return MeshWorld([2, 2]) if "\nmesh:" in path.read_text() else 2


def _codes(findings: list) -> set[str]:
    return {f.code for f in findings}


# ---- the reader, on hand-written PTX -------------------------------------------------
STORE = "st.global.b32 [ %rd1 + 0 ], { %r1 };"
RELEASE = "@%p1 atom.global.sys.release.exch.b64 %rd2, [ %rd3 + 0 ], %rd4;"
ACQUIRE = "@%p2 atom.global.sys.acquire.add.u64 %rd5, [ %rd6 + 0 ], %rd7;"
LOAD = "ld.global.b32 { %r2 }, [ %rd8 + 0 ];"


@pytest.mark.parametrize("body,codes", [
    ([STORE, RELEASE], {"release-without-barrier"}),
    ([STORE, "bar.sync 0;", RELEASE], set()),
    ([RELEASE, STORE], set()),  # a store after the release is the next call's
    ([ACQUIRE, LOAD], {"acquire-without-barrier"}),
    ([ACQUIRE, "bar.sync 0;", LOAD], set()),
    ([ACQUIRE, "ld.volatile.global.b64 %rd9, [ %rd10 + 0 ];", "bar.sync 0;", LOAD], set()),
    (["div.full.f32 %r3, %r4, %r5;"], {"approximate-division"}),
    (["div.rn.f32 %r3, %r4, %r5;"], set()),
    (["ex2.approx.f32 %r3, %r4;"], set()),  # exp/log: math, compared within tolerance
    (["st.shared.v2.b8 [%r14], {%rs34, %rs33};"], {"byte-pair-shared-store"}),
    (["st.shared.b8 [%r14], %rs17;", "st.shared.v2.b32 [%r11], {%r1, %r2};"], set()),
], ids=["store-release", "store-bar-release", "release-store", "acquire-load",
        "acquire-bar-load", "volatile-flags", "div-full", "div-rn", "ex2", "byte-pairs",
        "bytes-words"])
def test_the_reader_finds_each_class(body: list[str], codes: set[str]) -> None:
    assert _codes(check_ptx("k", "\n".join(body))) == codes


# ---- every schedule as emitted ---------------------------------------------------------
def test_every_schedule_compiles_for_sm90_with_no_finding() -> None:
    results = check_schedules([(p, _world(p)) for p in FILES])
    for path, (findings, variants) in zip(FILES, results, strict=True):
        assert variants > 0, f"{path.name}: no kernel was launched"
        assert not findings, f"{path.name}:\n" + "\n".join(f.render() for f in findings)


# ---- the capture launches what a whole run launches ----------------------------------
def test_the_capture_launches_every_variant_a_whole_run_launches() -> None:
    """The sweep's capture (no float64 reference, no comparison, polls that yield) and a
    whole CPU run (the capture before) launch the same kernel variants: a file of two
    slots (call 2 uses slot 0 again), a mesh file whose kernel branches on its rank, a
    ragged exchange with fp8 scales (engine steps write the counts it reads), a W = 2
    file whose kernel branches on its rank (the last rank's variants too)."""
    files = [ROOT / f for f in ("schedules/kimi_k3_dcp.yaml", "schedules/ops/broadcast_axis.yaml",
                                "schedules/ops/ragged_all_to_all_fp8_deepep.yaml",
                                "schedules/ops/reduce.yaml")]
    schedules = [(p, _world(p)) for p in files]
    fast = capture_schedules(schedules, reference=False)
    whole = capture_schedules(schedules, reference=True)
    for path, got, want in zip(files, fast, whole, strict=True):
        assert want, f"{path.name}: no kernel was launched"
        assert len(got) == len(want) and set(got) == set(want), (
            path.name, set(want) - set(got), set(got) - set(want))
    last = {name for name, _, kwargs in fast[3] if ("RANK", ("value", 1)) in kwargs}
    assert last, "reduce.yaml: no launch of the last rank's side of a RANK branch"


# ---- each class, put back into an emitted module -----------------------------------
@pytest.mark.parametrize("schedule,patch,code", [
    ("schedules/kimi_k3_dcp.yaml", (RELEASE_BARRIER, "pass"), "release-without-barrier"),
    ("schedules/ops/ragged_all_to_all_fp8_group.yaml",  # dcpc's rule (the gallery's MoE
     # divides in _dcpc_deepep_scales, a device function: not in the module's text)
     ("tl.math.div_rn(448.0, amax)", "448.0 / amax"), "approximate-division"),
    # the all_to_all's [8, 128] f32 tile on 4 warps, as launched before _fp8_tile
    ("schedules/ops/ragged_all_to_all_fp8_group.yaml",
     ("self._fp8_tile(_tune, _block_r, _block_c, 128)", "(_block_r, _block_c, _tune.num_warps)"),
     "byte-pair-shared-store"),
], ids=["no-barrier-before-release", "approximate-scale", "fp8-byte-pairs"])
def test_a_mutation_of_each_class_is_found(schedule: str, patch: tuple[str, str],
                                           code: str) -> None:
    ((findings, _),) = check_schedules([(ROOT / schedule, 2)], patch=(patch,))
    assert code in _codes(findings), [f.render() for f in findings]
