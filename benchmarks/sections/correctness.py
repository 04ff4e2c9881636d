"""Section correctness: every decode schedule (and kv_gather) on each backend against
float64 references, the backends against each other, the NCCL baselines against the same
references (multi-GPU runs only: NCCL cannot put several ranks on one GPU). At the first
H, every case again with the inputs strided as engines pass them (backend
``<name>+strided``: a head-strided query, an output sliced out of a padded buffer, an LSE
transposed from [H, T])."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.support.baselines import nccl_a2a_fused, nccl_agrs_fused, nccl_gather
from benchmarks.support.checking import score as _score
from benchmarks.support.checking import snapshotter as _snapshotter
from benchmarks.support.context import Ctx, GpuStuck, barrier, go, sync, warm
from benchmarks.support.modules import Registry, run_steps
from benchmarks.support.reference import Ref, bad_count, case_inputs, case_refs, kv_case, make_case
from benchmarks.support.steps import DECODE

KV_ROWS = (1, 7, 1000)


def correctness(ctx: Ctx, reg: Registry, heads: list[int], tokens: list[int],
                backends: list[str]) -> None:
    """Every decode schedule and backend vs float64 references; backends vs each other."""
    recs = ctx.results.setdefault("correctness", [])
    W = ctx.world
    for H in heads:
        for T in tokens:
            if not go(ctx, 60.0):
                ctx.error("correctness", f"H{H}/T{T}", "skipped: deadline")
                continue
            case = make_case(T, H, W, seed=1000 * H + T, device=ctx.device)
            inputs = case_inputs(case, ctx.rank)
            variants = [(b, inputs) for b in backends]
            if H == heads[0]:
                variants += [(f"{b}+strided", strided(inputs)) for b in backends]
            for schedule in DECODE:
                refs = case_refs(case, ctx.rank, schedule)
                per_backend: dict[str, dict[str, torch.Tensor]] = {}
                for name, env in variants:
                    backend = name.split("+")[0]
                    item = f"{schedule}/{name}/H{H}/T{T}"
                    snaps: dict[str, torch.Tensor] = {}
                    try:
                        inst = reg.get(schedule, H, backend)
                        warm(ctx, lambda: run_steps(inst, schedule, env, slot=0,  # noqa: B023
                                                    after=_snapshotter(snaps)))  # noqa: B023
                        run_steps(inst, schedule, env, slot=0, after=_snapshotter(snaps))
                        barrier(ctx)
                        score = _score(snaps, refs)
                        if name == backend:
                            per_backend[backend] = snaps
                        ok = bool(score) and all(v["bad"] == 0 for v in score.values())
                        recs.append({"schedule": schedule, "backend": name, "H": H, "T": T,
                                     "ok": ok, "buffers": score})
                    except GpuStuck:
                        raise
                    except Exception as exc:  # noqa: BLE001 - record and go on
                        ctx.error("correctness", item, exc)
                        recs.append({"schedule": schedule, "backend": name, "H": H,
                                     "T": T, "ok": False, "error": str(exc)[:300]})
                        barrier(ctx)
                if len(per_backend) == 2:
                    recs.append(_cross(schedule, H, T, per_backend, refs))
            if ctx.comm is None:  # NCCL cannot put several ranks on one GPU
                _baselines_check(ctx, case, inputs, recs)
            ctx.log(f"correctness H={H} T={T}: "
                    f"{sum(r['ok'] for r in recs)}/{len(recs)} ok so far")
    _kv_check(ctx, reg, backends, recs)


def strided(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values, laid out as engines hand them over: q_local [T, H/W, D] a view of a
    head-padded buffer, o_part [T, H, Dv] sliced out of [T, H + 2, Dv + 64], lse_part
    [T, H] the transpose of an [H, T] tensor."""
    out = dict(inputs)
    q, o, lse = inputs["q_local"], inputs["o_part"], inputs["lse_part"]
    qb = torch.zeros(q.shape[0], q.shape[1] + 1, q.shape[2] + 32, dtype=q.dtype, device=q.device)
    qb[:, 1:, 16:16 + q.shape[2]] = q
    out["q_local"] = qb[:, 1:, 16:16 + q.shape[2]]
    ob = torch.zeros(o.shape[0], o.shape[1] + 2, o.shape[2] + 64, dtype=o.dtype, device=o.device)
    ob[:, 1:1 + o.shape[1], :o.shape[2]] = o
    out["o_part"] = ob[:, 1:1 + o.shape[1], :o.shape[2]]
    out["lse_part"] = lse.t().contiguous().t()
    return out


def _cross(schedule: str, H: int, T: int, per_backend: dict[str, dict[str, torch.Tensor]],
           refs: dict[str, Ref]) -> dict[str, Any]:
    """The two backends against each other: bit-exact where exact, max diff elsewhere."""
    (name_a, a), (name_b, b) = per_backend.items()
    diffs: dict[str, Any] = {}
    ok = True
    for buf in sorted(set(a) & set(b)):
        if buf in refs and refs[buf].kind == "exact":
            bad, _ = bad_count(a[buf], Ref("exact", b[buf]))
            diffs[buf] = {"bad": int(bad.item())}
            ok &= diffs[buf]["bad"] == 0
        elif a[buf].shape == b[buf].shape:
            d = (a[buf].double() - b[buf].double()).abs().nan_to_num(nan=float("inf"))
            diffs[buf] = {"max_diff": float(d.max().item()) if d.numel() else 0.0}
    return {"schedule": schedule, "backend": f"{name_a}=={name_b}", "H": H, "T": T,
            "ok": ok, "buffers": diffs}


def _baselines_check(ctx: Ctx, case: Any, inputs: dict[str, torch.Tensor],
                     recs: list[dict[str, Any]]) -> None:
    """The NCCL baselines compute the same thing (else their timings mean nothing)."""
    refs = case_refs(case, ctx.rank, "kimi_k3_dcp_ag_rs")
    o, lse = inputs["o_part"], inputs["lse_part"]
    sl, qsl = inputs["seq_lens"], inputs["query_start_loc"]
    makers = {
        "nccl_gather": lambda: nccl_gather(inputs["q_local"], case.H),
        "nccl_agrs_fused": lambda: nccl_agrs_fused(o, lse, sl, qsl, ctx.rank, ctx.world),
        "nccl_a2a_fused": lambda: nccl_a2a_fused(o, lse, sl, qsl, ctx.world),
    }
    for name, make in makers.items():
        try:
            fn, got = make()
            fn()
            sync(ctx)
            bad, err = bad_count(got, refs["q_full" if name == "nccl_gather" else "out"])
            recs.append({"schedule": "baseline", "backend": name, "H": case.H, "T": case.T,
                         "ok": int(bad.item()) == 0,
                         "buffers": {"out": {"bad": int(bad.item()),
                                             "max_err": float(err.item())}}})
        except GpuStuck:
            raise
        except Exception as exc:  # noqa: BLE001
            ctx.error("correctness", f"baseline {name} H{case.H} T{case.T}", exc)
            recs.append({"schedule": "baseline", "backend": name, "H": case.H, "T": case.T,
                         "ok": False, "error": str(exc)[:300]})
        barrier(ctx)


def _kv_check(ctx: Ctx, reg: Registry, backends: list[str], recs: list[dict[str, Any]]
              ) -> None:
    for n_rows in KV_ROWS:
        kv, full = kv_case(n_rows, ctx.world, seed=7 + n_rows, device=ctx.device)
        for backend in backends:
            try:
                snaps: dict[str, torch.Tensor] = {}
                inst = reg.get("kv_gather", None, backend)
                kv_env = {"kv_local": kv[ctx.rank].contiguous()}
                warm(ctx, lambda: run_steps(inst, "kv_gather", kv_env,  # noqa: B023
                                            after=_snapshotter(snaps)))  # noqa: B023
                run_steps(inst, "kv_gather", kv_env, after=_snapshotter(snaps))
                barrier(ctx)
                score = _score(snaps, {"kv_full": Ref("exact", full)})
                recs.append({"schedule": "kv_gather", "backend": backend, "H": None,
                             "T": n_rows, "ok": bool(score) and score["kv_full"]["bad"] == 0,
                             "buffers": score})
            except GpuStuck:
                raise
            except Exception as exc:  # noqa: BLE001
                ctx.error("correctness", f"kv_gather/{backend}/N{n_rows}", exc)
                recs.append({"schedule": "kv_gather", "backend": backend, "H": None,
                             "T": n_rows, "ok": False, "error": str(exc)[:300]})
                barrier(ctx)
