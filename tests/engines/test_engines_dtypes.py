"""What engines pass to the adapters: every group object they pass (a GroupCoordinator,
vLLM's test object with ``world_size`` and ``device_group`` only, a ProcessGroup) and
every dtype the adapters accept (bf16, f16, f32, fp8 e4m3), through the query gather,
the KV gather and the combine of ``MLADCPManager`` and SGLang's query gather, on the
``torch`` backend (gloo) at W = 2 and 3, the ``host`` backend at W = 2 and the
``local`` backend (threads) at W = 2 and 3, against float64 (gathers: bit for bit).

fp8 payloads used to fail on gloo ("Invalid scalar type", or a hang until gloo's
timeout): collectives move them as bytes (dcpc.runtime.collectives.wire)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dcpc.engines.common import resolve_group
from dcpc.harness.launch import launch
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.local import LocalGroup

pytestmark = pytest.mark.host

WORKSPACE = 8  # T = 12 calls take the fallback
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
TOL = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-4}  # the combine's outputs


def _parts(seed: int, world: int, shape: tuple[int, ...], dtype: torch.dtype
           ) -> list[torch.Tensor]:
    """Every rank's input (each rank builds all of them: the reference needs them)."""
    return [(torch.randn(*shape, generator=torch.Generator().manual_seed(seed + p)) * 3)
            .to(dtype) for p in range(world)]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    got = got.double()
    return bool(not torch.isnan(got).any()
                and ((got - want).abs() <= tol + tol * want.abs()).all())


def scenario(group: Any, r: int, world: int, backend: str, barrier: Any
             ) -> list[tuple[str, bool]]:
    """One rank's checks: (what, ok). ``group``: what the engine passes."""
    from dcpc.engines import reference as ref
    from dcpc.engines import sglang as S
    from dcpc.engines import vllm as V

    checks: list[tuple[str, bool]] = []
    heads, dq, dv = 2 * world, 24, 16
    for name in DTYPES:
        dt = getattr(torch, name)
        out_dt = dt if name in TOL else torch.bfloat16
        m = V.MLADCPManager(None, "cpu", 2, dq, dv, dt, out_dt, group=group,
                            max_num_tokens=WORKSPACE, num_ubatches=1, comm_backend="a2a",
                            backend=backend)
        for tokens in (3, WORKSPACE + 4):  # the module, then the fallback
            q = _parts(7 + tokens, world, (tokens, 2, dq), dt)
            full = m.query_gather(q[r])
            checks.append((f"{name} query gather T={tokens}", full.dtype == dt and
                           torch.equal(full.double(), ref.gather_heads(q))))
            barrier()
        ws = torch.empty(4 * world + 4, 40, dtype=dt)
        m.init_kv_gather(ws, 4 * world)
        for n in (3, 4 * world + 1):  # within the workspace, then past it
            kv = _parts(11 + n, world, (n, 40), dt)
            gathered = torch.full((world * n, 40), float("nan")).to(dt)
            m.kv_gather(gathered, kv[r])
            checks.append((f"{name} kv gather N={n}",
                           torch.equal(gathered.double(), ref.gather_rows(kv))))
            barrier()
        if name in TOL:  # partials in the output dtype, fp32 LSEs
            outs = _parts(3, world, (5, heads, dv), dt)
            lses = [x.float() for x in _parts(5, world, (5, heads), torch.float32)]
            got = m.combine(outs[r], lses[r], seq_lens=None, query_start_loc=None)
            want = ref.vllm_combine(outs, lses)[r][0]
            checks.append((f"{name} combine", got.dtype == dt and _close(got, want, TOL[name])))
            barrier()
        nope = _parts(21, world, (3, 2, 32), dt)
        pe = _parts(31, world, (3, 2, 16), dt)
        got_nope, got_pe = S.all_gather_q_for_mla_decode(nope[r], pe[r], group=group)
        checks.append((f"{name} sglang q gather",
                       torch.equal(got_nope.double(), ref.gather_heads(nope))
                       and torch.equal(got_pe.double(), ref.gather_heads(pe))))
        barrier()
    return checks


def group_scenario(kind: str, pg: Any, r: int, world: int, barrier: Any
                   ) -> list[tuple[str, bool]]:
    """The free functions with the group object ``kind`` engines pass."""
    from dcpc.engines import reference as ref
    from dcpc.engines import vllm as V

    group = {"coordinator": SimpleNamespace(device_group=pg, cpu_group=pg, world_size=world,
                                            rank_in_group=r),
             "minimal": SimpleNamespace(world_size=world, device_group=pg),  # vLLM's tests
             "process_group": pg}[kind]
    outs = _parts(40, world, (4, 2 * world, 16), torch.bfloat16)
    lses = _parts(50, world, (4, 2 * world), torch.float32)
    want = ref.vllm_combine(outs, lses)[r][0]
    checks = []
    for fn in (V.dcp_a2a_lse_reduce, V.cp_lse_ag_out_rs):
        got = fn(outs[r], lses[r], group)
        checks.append((f"{kind} {fn.__name__}", _close(got, want, 2e-2)))
        barrier()
    return checks


def worker(rank: int, world: int, cache: str, backend: str) -> list[tuple[str, bool]]:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update({"DCPC_CACHE_DIR": cache, "DCPC_MAX_NUM_TOKENS": str(WORKSPACE),
                       "DCPC_BACKEND": backend})
    pg = dist.group.WORLD
    checks = []
    for kind in ("minimal", "coordinator", "process_group"):
        checks += group_scenario(kind, pg, rank, world, dist.barrier)
    checks += scenario(SimpleNamespace(world_size=world, device_group=pg), rank, world,
                       backend, dist.barrier)
    dist.barrier()
    return checks


def _assert_all_ok(per_rank: list[list[tuple[str, bool]]]) -> None:
    for r, checks in enumerate(per_rank):
        assert len(checks) == 3 * 2 + 4 * 6 - 1, checks  # fp8 has no combine
        bad = [what for what, ok in checks if not ok]
        assert not bad, (r, bad)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One module cache for this file's launches: the first launch's ranks compile
    every schedule (side by side, written atomically), the later ones import them."""
    return str(tmp_path_factory.mktemp("dcpc-engines-"))


@pytest.mark.parametrize("world, backend", [(2, "torch"), (3, "torch"), (2, "host")])
def test_every_group_object_and_dtype_across_processes(world: int, backend: str,
                                                       cache: str) -> None:
    result = launch("test_engines_dtypes:worker", world,
                    {"cache": cache, "backend": backend}, timeout_s=600,
                    gloo_timeout_s=60)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    _assert_all_ok([[tuple(c) for c in v] for v in result.values()])


@pytest.mark.parametrize("world", [2, 3])
def test_every_dtype_on_the_local_backend(world: int, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", str(WORKSPACE))
    got = LocalGroup(world, "cpu").run(
        lambda rank: scenario(rank, rank.rank, world, "local", rank.barrier))
    for r, checks in enumerate(got):
        assert len(checks) == 4 * 6 - 1, checks
        assert not [what for what, ok in checks if not ok], (r, checks)


def test_an_object_that_is_no_group_is_refused_by_name() -> None:
    with pytest.raises(DcpcArgumentError, match="SimpleNamespace is not a DCP group"):
        resolve_group(SimpleNamespace(world_size=2), torch.device("cpu"))
