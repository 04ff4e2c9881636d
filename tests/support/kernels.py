"""Helpers shared by the kernel and end-to-end tests (no tests here).

``compile_text`` compiles a schedule to a module file and imports it; ``load`` imports
a generated file (in child processes too). Workers for ``dcpc.harness.launch`` live in
test_kernels_e2e.py and import this module by name (tests/ is on sys.path).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = ROOT / "schedules"


def compile_text(text: str, out_dir: Path, worlds: tuple[int, ...] = (1, 2, 3, 4)) -> Path:
    """Parse, lower and emit a schedule; write <schedule>.py into ``out_dir``."""
    from dcpc.codegen.emit import emit
    from dcpc.codegen.lower import lower
    from dcpc.lang.parse import parse_text

    schedule = parse_text(text, "test.yaml")
    plan = lower(schedule, worlds)
    path = out_dir / f"{plan.schedule}.py"
    path.write_text(emit(plan))
    return path


def compile_file(path: Path, out_dir: Path) -> Path:
    return compile_text(path.read_text(), out_dir, tuple(range(1, 9)))


def load(path: str | Path) -> ModuleType:
    """Import a generated module from its file (a unique name per file content)."""
    from dcpc.runtime.loading import import_file

    path = Path(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return import_file(path, f"dcpc_gen_{path.stem}_{digest}")


def the_class(module: ModuleType) -> type:
    from dcpc.runtime.loading import schedule_class

    return schedule_class(module)


MERGE_SCHEDULE = """
schedule: merge_{tag}
slots: 1
sizes:
  T: {{max: 16}}
  B: {{max: 8}}
  G: 3
  Dv: {dv}
buffers:
  o:        {{shape: [W, T, G, Dv], dtype: {odtype}, symmetric: true}}
  lse:      {{shape: [W, T, G], dtype: f32, symmetric: true, lse_base: {base}}}
  o_own:    {{shape: [T, G, Dv], dtype: {odtype}}}
  out:      {{shape: [T, G, Dv], dtype: {odtype}}}
  out_lse:  {{shape: [T, G], dtype: f32, lse_base: {base}}}
  seq_lens: {{shape: [B], dtype: i32}}
  query_start_loc: {{shape: [B+1], dtype: i32}}
steps:
  - produce: {{op: external, writes: [o, lse, o_own]}}
  - merge:   {{op: lse_combine, src: [o, lse], dst: out{ret}{mask}}}
  - correct: {{op: lse_correct, src: [o_own, lse], dst: out{ret2}{mask}}}
"""


def merge_schedule(
    odtype: str = "bf16",
    base: str = "e",
    return_lse: bool = True,
    mask: bool = True,
    interleave: int = 1,
    dv: int = 40,
) -> str:
    mask_text = (
        f", mask_empty: {{seq_lens: seq_lens, query_start_loc: query_start_loc, "
        f"interleave: {interleave}}}"
        if mask
        else ""
    )
    tag = f"{odtype}_{base}_{int(return_lse)}_{int(mask)}_{interleave}_{dv}"
    return MERGE_SCHEDULE.format(
        tag=tag,
        dv=dv,
        odtype=odtype,
        base=base,
        ret=", return_lse: out_lse" if return_lse else "",
        ret2=", return_lse: out_lse" if return_lse else "",
        mask=mask_text,
    )


def construct_on_local_ranks(cls: type, world: int, sizes_of: Callable[[int], dict[str, int]],
                             timeout_s: float = 20) -> dict[int, str]:
    """Construct ``cls`` on every rank of a LocalGroup of ``world`` CPU ranks (backend
    ``local``, each rank's sizes ``sizes_of(rank)``): rank -> its DcpcArgumentError's
    message, or "constructed" (the module then closed)."""
    from dcpc.runtime.errors import DcpcArgumentError
    from dcpc.runtime.local import LocalGroup

    said: dict[int, str] = {}

    def body(rank: Any) -> None:
        try:
            m = cls(rank, sizes=sizes_of(rank.rank), device="cpu", backend="local",
                    timeout_s=timeout_s)
        except DcpcArgumentError as err:
            said[rank.rank] = str(err)
            return
        said[rank.rank] = "constructed"
        m.close()

    LocalGroup(world, "cpu", timeout_s=60).run(body, timeout_s=60)
    return said


# A local group's run that only has to end, not hang (the house standard: a deadline with
# margin, scaled by measured progress, not tuned to an idle machine): a wall bound no
# loaded machine reaches while the ranks move, and a stall bound counted in the progress
# a busy thread makes (LocalGroup.run's stall_s: no rank said or ended anything new for
# that long at the CPU share measured then). On an idle machine a hang is still named
# after RANKS_STALL_S seconds, as the fixed 120 s wall bound did; on a loaded one the
# bound grows with the load instead of failing the test.
RANKS_WALL_S, RANKS_STALL_S = 600.0, 120.0


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(rank, *args)`` on ``world`` threads of a CPU ``LocalGroup``, bounded as above:
    the ranks' return values; ``LocalRankHang`` for a stall, ``LocalRankError`` for a
    failing rank (dcpc.runtime.local)."""
    from dcpc.runtime.local import LocalGroup

    return LocalGroup(world, "cpu", timeout_s=RANKS_WALL_S).run(fn, *args,
                                                                 stall_s=RANKS_STALL_S)


def run_threads(text: str, name: str, world: int, sizes: dict[str, int],
                call: Callable[[Any, int], Any]) -> list[Any]:
    """Schedule ``text`` (named ``name``) compiled and run on a ``world``-rank local group
    (ranks as threads, the ``local`` backend): ``call(instance, rank)`` on every rank,
    the tensors it returns (cloned) or the run-time error it raised (str)."""
    import tempfile

    from dcpc.harness.run import compile_to
    from dcpc.harness.worker import load_module_class
    from dcpc.runtime.errors import DcpcArgumentError, DcpcPeerFailedError

    with tempfile.TemporaryDirectory(prefix=f"dcpc-{name}-") as tmp:
        path = Path(tmp) / f"{name}.yaml"
        path.write_text(text)
        _, module, _, _ = compile_to(str(path), Path(tmp), world)

        def rank_main(rank: Any) -> Any:
            inst = load_module_class(module, name)(rank, sizes=sizes, device="cpu",
                                                   backend="local", timeout_s=30)
            try:
                return [t.clone() for t in call(inst, rank.rank)]
            except (DcpcArgumentError, DcpcPeerFailedError) as exc:
                return str(exc)
            finally:
                inst.close()

        return run_ranks(world, rank_main)
