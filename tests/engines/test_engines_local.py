"""The vLLM and SGLang adapters at W = 2 and 3 on the ``local`` backend (W ranks as
threads of one child process, Triton interpreter on CPU), against dcpc.engines.reference
in float64.

Each child process runs every scenario below for one W and reports, per scenario and
rank, whether the result matched (bf16 tolerance: atol = rtol = 2e-2), NaNs, the -inf
pattern of returned LSEs, shapes, strides and what was logged. Inputs are random, with
NaN/+inf garbage in empty shards' partials and in CUDA-graph padding rows; module
buffers are dcpc's own (fresh runs poison nothing here, so the masks must really
zero those rows).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ATOL = 2e-2  # and the same rtol: bf16 outputs
WORKSPACE = 8  # DCPC_MAX_NUM_TOKENS in the child: T=12 calls must fall back
DEV = os.environ.get("DCPC_TEST_DEVICE", "cpu")  # the child's device ("cuda:0": one GPU)


# ---- the child ----------------------------------------------------------------------------
def _local_lens(full: list[int], world: int, rank: int) -> list[int]:
    """vLLM's get_dcp_local_seq_lens with interleave 1."""
    return [s // world + (1 if s % world > rank else 0) for s in full]


def _inputs(seed: int, world: int, tokens: int, heads: int, dv: int, *, garbage: bool,
            lse_dtype: Any = None) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    full = [1, 2, 5 + world]  # request 0 is empty on ranks >= 1
    qsl = torch.tensor([0, 2, 3, 4], dtype=torch.int32)  # rows 4.. are padding
    lens = [torch.tensor(_local_lens(full, world, r), dtype=torch.int32) for r in range(world)]
    outs, lses = [], []
    for r in range(world):
        o = torch.randn(tokens, heads, dv, generator=g)
        lse = torch.randn(tokens, heads, generator=g) * 2
        if garbage:
            for row in range(tokens):
                req = 0 if row < 2 else row - 1
                if row >= 4 or lens[r][req] == 0:
                    o[row] = float("nan")
                    lse[row] = float("inf") if row % 2 else float("nan")
        else:
            lse[0, 0] = float("-inf")  # one head of row 0: -inf on every rank
        outs.append(o.bfloat16().to(DEV))
        lses.append(lse.to(lse_dtype or torch.float32).to(DEV))
    return {"outs": outs, "lses": lses, "lens": [x.to(DEV) for x in lens], "qsl": qsl.to(DEV)}


def _compare(got: Any, want: Any, tol: float = ATOL) -> dict[str, Any]:
    import torch

    from dcpc.runtime.local import to_host  # a bare .cpu() can hang ranks on one GPU

    got = to_host(got.detach().double())
    want = to_host(want.double())
    finite = torch.isfinite(want)
    same_inf = bool(torch.equal(got[~finite], want[~finite])
                    and torch.isfinite(got[finite]).all())  # -inf exactly where wanted
    g, w = torch.where(finite, got, 0.0), torch.where(finite, want, 0.0)
    excess = ((g - w).abs() - (tol + tol * w.abs())).max().item()
    return {"ok": excess <= 0 and same_inf and not bool(torch.isnan(got).any()),
            "excess": excess, "nan": bool(torch.isnan(got).any()), "inf_ok": same_inf,
            "shape": list(got.shape)}


def _helix_reference(outs: list[Any], lses: list[Any], world: int, base_e: bool
                     ) -> list[tuple[Any, Any]]:
    """closed vLLM PR #34024's Helix merge (_lse_weighted_combine in vllm/v1/attention/ops/helix.py)
    in float64, written from its math: NaN/+inf LSEs count as -inf, weights are
    softmax(lse) over the shards, rank r keeps heads r*H/N ..; finite partials only."""
    import torch

    exp, log = (torch.exp, torch.log) if base_e else (torch.exp2, torch.log2)
    o = torch.stack([x.cpu().double() for x in outs])  # [N, B, H, D]
    lse = torch.stack([x.cpu().double() for x in lses])  # [N, B, H]
    lse = torch.where(torch.isnan(lse) | torch.isinf(lse), float("-inf"), lse)
    m = lse.amax(0)
    m = torch.where(m == float("-inf"), 0.0, m)
    w = exp(lse - m)
    total = w.sum(0)
    out = (o * (w / total.clamp(min=1e-10)).unsqueeze(-1)).sum(0)
    g = log(total) + m
    part = out.shape[1] // world
    return [(out[:, r * part:(r + 1) * part], g[:, r * part:(r + 1) * part])
            for r in range(world)]


def scenario(name: str, rank: Any, r: int, world: int, barrier: Any, backend: str
             ) -> list[dict[str, Any]]:
    """Scenario ``name`` on rank ``r`` of the group ``rank`` (a LocalRank, a torch
    ProcessGroup or a GroupCoordinator-like object); the comparisons it made.
    ``barrier()``: every rank's results are read before the next call reuses the
    module buffers they are views of."""
    import torch

    from dcpc.engines import reference as ref
    from dcpc.engines import sglang as S
    from dcpc.engines import vllm as V
    from dcpc.runtime.local import to_host

    name = ALIASES.get(name, name)
    seed = sum(map(ord, name)) + world
    T, H, D = 6, 4 * world, 32
    checks: list[dict[str, Any]] = []

    def check(what: str, got: Any, want: Any, tol: float = ATOL) -> None:
        checks.append({"what": what, **_compare(got, want, tol)})

    if name in ("vllm_a2a_mask", "vllm_ag_rs_mask", "vllm_repeat"):
        fn = V.cp_lse_ag_out_rs if "ag_rs" in name else V.dcp_a2a_lse_reduce
        for call in range(3 if name == "vllm_repeat" else 1):
            x = _inputs(seed + call, world, T, H, D, garbage=True)
            want = ref.vllm_combine(x["outs"], x["lses"], local_lens=x["lens"], qsl=x["qsl"])
            o, lse = fn(x["outs"][r], x["lses"][r], rank, return_lse=True,
                        seq_lens=x["lens"][r], query_start_loc=x["qsl"])
            check(f"out{call}", o, want[r][0])
            check(f"lse{call}", lse, want[r][1])
            checks.append({"what": "lse dtype", "ok": lse.dtype == torch.float32})
            barrier()  # the next call reuses the buffers these views point into
    elif name in ("vllm_base2_bf16_lse", "vllm_ag_rs_base2_bf16_lse"):
        fn = V.cp_lse_ag_out_rs if "ag_rs" in name else V.dcp_a2a_lse_reduce
        x = _inputs(seed, world, T, H, D, garbage=False, lse_dtype=torch.bfloat16)
        want = ref.vllm_combine(x["outs"], x["lses"], base2=True)
        o, lse = fn(x["outs"][r], x["lses"][r], rank, return_lse=True, is_lse_base_on_e=False)
        check("out", o, want[r][0])
        check("lse", lse, want[r][1])
        wanted = torch.bfloat16 if "ag_rs" in name else torch.float32  # vLLM's dtypes
        checks.append({"what": "lse dtype", "ok": lse.dtype == wanted})
    elif name in ("vllm_strided", "vllm_ag_rs_strided"):
        fn = V.cp_lse_ag_out_rs if "ag_rs" in name else V.dcp_a2a_lse_reduce
        x = _inputs(seed, world, T, H, D, garbage=True)
        big = torch.randn(T, H, D + 16).bfloat16().to(DEV)
        big[..., :D] = x["outs"][r]
        lse_ht = x["lses"][r].t().contiguous()  # FA's head-major LSE [H, T]
        want = ref.vllm_combine(x["outs"], x["lses"], local_lens=x["lens"], qsl=x["qsl"])
        o, lse = fn(big[..., :D], lse_ht.t(), rank, return_lse=True,
                    seq_lens=x["lens"][r], query_start_loc=x["qsl"])
        check("out", o, want[r][0])
        check("lse", lse, want[r][1])
    elif name == "vllm_helix":  # PR #34024's Helix combine (dcpc.engines.helix)
        from dcpc.engines.helix import helix_alltoall_lse_reduce

        for base_e in (True, False):
            x = _inputs(seed, world, T, H, D, garbage=False)
            lses = [lse.clone() for lse in x["lses"]]
            lses[world - 1][1, :2] = float("nan")  # vLLM's Helix: NaN / +inf count as -inf
            lses[0][2, 1] = float("inf")
            want = _helix_reference(x["outs"], lses, world, base_e)
            o, lse = helix_alltoall_lse_reduce(x["outs"][r], lses[r], rank, return_lse=True,
                                               is_lse_base_on_e=base_e)
            check(f"out base_e={base_e}", o, want[r][0])
            check(f"lse base_e={base_e}", lse, want[r][1])
            checks.append({"what": "dtypes", "ok": o.dtype == x["outs"][r].dtype
                           and lse.dtype == lses[r].dtype})
            barrier()
    elif name == "vllm_over_workspace":
        for fn in (V.dcp_a2a_lse_reduce, V.cp_lse_ag_out_rs):
            x = _inputs(seed, world, WORKSPACE + 4, H, D, garbage=True)
            want = ref.vllm_combine(x["outs"], x["lses"], local_lens=x["lens"], qsl=x["qsl"])
            o, lse = fn(x["outs"][r], x["lses"][r], rank, return_lse=True,
                        seq_lens=x["lens"][r], query_start_loc=x["qsl"])
            check(f"{fn.__name__} out", o, want[r][0])
            check(f"{fn.__name__} lse", lse, want[r][1])
    elif name == "vllm_no_requests":
        x = _inputs(seed, world, T, H, D, garbage=False)
        empty = torch.zeros(0, dtype=torch.int32, device=DEV)
        qsl0 = torch.zeros(1, dtype=torch.int32, device=DEV)
        for fn in (V.dcp_a2a_lse_reduce, V.cp_lse_ag_out_rs):
            o, lse = fn(x["outs"][r], x["lses"][r], rank, return_lse=True,
                        seq_lens=empty, query_start_loc=qsl0)
            check(f"{fn.__name__} out", o, torch.zeros(T, H // world, D))
            check(f"{fn.__name__} lse", lse, torch.full((T, H // world), float("-inf")))
    elif name == "vllm_switch_off":  # VLLM_USE_DIRECT_DCP_A2A=0 (CASE_ENV)
        x = _inputs(seed, world, T, 2 * H, D, garbage=True)  # shapes no module has
        want = ref.vllm_combine(x["outs"], x["lses"], local_lens=x["lens"], qsl=x["qsl"])
        o = V.dcp_a2a_lse_reduce(x["outs"][r], x["lses"][r], rank,
                                 seq_lens=x["lens"][r], query_start_loc=x["qsl"])
        check("out", o, want[r][0])
        from dcpc.engines import runners

        checks.append({"what": "no module", "ok": not any(
            k[3] == 2 * H for k, _ in runners.built())})
    elif name == "vllm_manager":
        for comm, ubatches in (("a2a", 2), ("ag_rs", 1)):
            m = V.MLADCPManager(None, DEV, 4, 48, D, torch.bfloat16, torch.bfloat16,
                                padded_num_heads=H + 2, group=rank, max_num_tokens=WORKSPACE,
                                num_ubatches=ubatches, comm_backend=comm, backend=backend)
            for ub in range(ubatches):
                x = _inputs(seed + ub, world, T, H, D, garbage=True)
                want = ref.vllm_combine(x["outs"], x["lses"], local_lens=x["lens"],
                                        qsl=x["qsl"])
                q = [torch.randn(T, 4, 48, generator=torch.Generator().manual_seed(p + ub))
                     .bfloat16().to(DEV) for p in range(world)]
                full = m.query_gather(q[r], slot=ub)
                check(f"{comm} q{ub}", full, ref.gather_heads(q))
                checks.append({"what": "padded storage", "ok": full.is_contiguous() and  # vLLM's
                               full.untyped_storage().nbytes() >= T * (H + 2) * 48 * 2})
                o = m.combine(x["outs"][r], x["lses"][r], seq_lens=x["lens"][r],
                              query_start_loc=x["qsl"], slot=ub)
                check(f"{comm} out{ub}", o, want[r][0])
            barrier()
            n = 3  # the KV gather, one slot per microbatch (chunked prefill under DBO)
            ws = torch.empty(4 * world + 4, 40, dtype=torch.bfloat16, device=DEV)  # [T+T/W, C]
            m.init_kv_gather(ws, 4 * world)
            for ub in [*range(ubatches)] * 2:
                parts = [torch.randn(n, 40, generator=torch.Generator().manual_seed(9 + p + ub))
                         .bfloat16().to(DEV) for p in range(world)]
                gathered = torch.full((world * n, 40), float("nan"), dtype=torch.bfloat16,
                                      device=DEV)
                m.kv_gather(gathered, parts[r], slot=ub)
                checks.append({"what": f"{comm} kv gather {ub}", "ok": torch.equal(
                    to_host(gathered.double()), ref.gather_rows(parts))})
            barrier()
    elif name == "sglang":
        x = _inputs(seed, world, T, H, D, garbage=False)
        want_a2a = ref.sglang_a2a(x["outs"], x["lses"])
        check("a2a", S.dcp_a2a_lse_reduce(x["outs"][r], x["lses"][r], rank), want_a2a[r])
        want_rs = ref.sglang_ag_rs_mla(x["outs"], x["lses"], base2=True)
        got = S.cp_lse_ag_out_rs_mla(x["outs"][r], x["lses"][r], rank)
        check("ag_rs_mla", got, want_rs[r])
        g = torch.Generator().manual_seed(seed)
        nope = [torch.randn(T, 4, 32, generator=g).bfloat16().to(DEV) for _ in range(world)]
        pe = [torch.randn(T, 4, 16, generator=g).bfloat16().to(DEV) for _ in range(world)]
        got_nope, got_pe = S.all_gather_q_for_mla_decode(nope[r], pe[r], group=rank)
        check("q_nope", got_nope, ref.gather_heads(nope))
        check("q_pe", got_pe, ref.gather_heads(pe))
        try:
            S.dcp_a2a_lse_reduce(x["outs"][r], x["lses"][r].bfloat16(), rank)
            checks.append({"what": "bf16 lse refused", "ok": False})
        except ValueError as exc:
            checks.append({"what": "bf16 lse refused", "ok": "float32" in str(exc)})
    elif name == "sglang_fp8_partials":  # no module takes them: the torch fallback
        x = _inputs(seed, world, T, H, D, garbage=False)
        fp8 = [o.to(torch.float8_e4m3fn) for o in x["outs"]]
        got = S.dcp_a2a_lse_reduce(fp8[r], x["lses"][r], rank)
        checks.append({"what": "fp8 out", "ok": got.dtype == torch.float8_e4m3fn})
        check("fp8 partials", got.double(), ref.sglang_a2a(fp8, x["lses"])[r],
              tol=0.13)  # one e4m3 step (2**-3)
    elif name == "fp8_output":
        import dcpc.engines.combine as C
        from dcpc.engines import runners
        from dcpc.engines.common import CombineSpec, resolve_group

        x = _inputs(seed, world, T, H, D, garbage=True)
        want = ref.vllm_combine(x["outs"], x["lses"], local_lens=x["lens"], qsl=x["qsl"])
        scale = torch.tensor([0.004], device=DEV)  # |x| > 1.79: past 448 (clamped)
        km = C.kernel_mask()
        lse = x["lses"][r] if km else C.mask_at_source(x["lses"][r], x["lens"][r], x["qsl"])
        mask = (x["lens"][r], x["qsl"]) if km else (None, None)
        for path in ("fused", "a2a", "ag_rs"):
            spec = CombineSpec(path, D, out_dtype="fp8e4m3", max_tokens=WORKSPACE,
                               max_reqs=WORKSPACE, mask=km)
            run = runners.runner(C.CombineRunner, spec,
                                 resolve_group(rank, torch.device(DEV)), H, backend)
            o, _ = run.run(x["outs"][r], lse, *mask, scale=scale)
            q = (want[r][0] / 0.004).clamp(-448, 448)
            err = (to_host(o.double()) - q).abs() - 0.13 * q.abs()  # one e4m3 step: 2**-3
            checks.append({"what": f"fp8 {path}", "ok": o.dtype == torch.float8_e4m3fn
                           and err.max().item() <= 2.0**-9, "excess": err.max().item()})
            barrier()
    elif name == "forced_unsupported":  # VLLM_USE_DIRECT_DCP_A2A=1 (CASE_ENV)
        x = _inputs(seed, world, T, H, D, garbage=False)
        try:
            V.dcp_a2a_lse_reduce(x["outs"][r].to(torch.float8_e4m3fn), x["lses"][r], rank)
            checks.append({"what": "fp8 partials refused when forced", "ok": False})
        except ValueError as exc:
            checks.append({"what": "fp8 partials refused when forced",
                           "ok": "VLLM_USE_DIRECT_DCP_A2A=1" in str(exc)})
    elif name == "ag_rs_vs_a2a_error":  # ag_rs sums in fp32: no worse than a2a
        x = _inputs(seed, world, T, H, D, garbage=False)
        want = ref.vllm_combine(x["outs"], x["lses"])[r][0]
        a2a = to_host(V.dcp_a2a_lse_reduce(x["outs"][r], x["lses"][r], rank).double())
        barrier()
        rs = to_host(V.cp_lse_ag_out_rs(x["outs"][r], x["lses"][r], rank).double())
        e_a2a, e_rs = (a2a - want).abs(), (rs - want).abs()
        step = 2.0 ** -8 * want.abs().max().item()  # one bf16 rounding of the largest
        checks.append({"what": "ag_rs error <= a2a error",
                       "ok": e_rs.mean().item() <= 1.01 * e_a2a.mean().item()
                       and e_rs.max().item() <= e_a2a.max().item() + step,
                       "a2a": e_a2a.max().item(), "ag_rs": e_rs.max().item()})
        barrier()
    else:
        raise ValueError(name)
    return checks


def _run_case(group: Any, name: str, world: int) -> list[list[dict[str, Any]]]:
    """Scenario ``name`` on every rank of a LocalGroup (threads). On CUDA it runs inside
    compile_only() first: no JIT compile may happen while a peer's kernel spins
    (docs/engines.md, section 8)."""
    from dcpc.runtime.local import compile_only

    def warm(rank: Any) -> None:
        with compile_only():  # twice: a call's release() runs at the start of the next
            for _ in range(2):
                scenario(name, rank, rank.rank, world, rank.group.barrier, "local")
        rank.barrier()

    saved = {k: os.environ.get(k) for k in CASE_ENV.get(name, {})}
    os.environ.update(CASE_ENV.get(name, {}))  # one process: set for every rank's thread
    try:
        if DEV != "cpu":
            group.run(warm)
        return group.run(lambda rank: scenario(name, rank, rank.rank, world, rank.barrier,
                                               "local"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


CASES = ["vllm_a2a_mask", "vllm_ag_rs_mask", "vllm_repeat", "vllm_base2_bf16_lse",
         "vllm_ag_rs_base2_bf16_lse", "vllm_strided", "vllm_ag_rs_strided",
         "vllm_over_workspace", "vllm_no_requests", "vllm_switch_off", "vllm_manager",
         "sglang", "sglang_fp8_partials", "fp8_output", "forced_unsupported",
         "ag_rs_vs_a2a_error", "vllm_helix"]


# the same scenarios with the empty-shard mask in-kernel (DCPC_KERNEL_MASK=1; see
# dcpc.engines.combine.kernel_mask)
ALIASES = {"kernel_mask_a2a": "vllm_a2a_mask", "kernel_mask_ag_rs": "vllm_ag_rs_mask",
           "kernel_mask_repeat": "vllm_repeat", "kernel_mask_strided": "vllm_strided",
           "kernel_mask_manager": "vllm_manager", "kernel_mask_fp8": "fp8_output"}
CASES += list(ALIASES)
CASE_ENV = {"vllm_switch_off": {"VLLM_USE_DIRECT_DCP_A2A": "0"},
            "forced_unsupported": {"VLLM_USE_DIRECT_DCP_A2A": "1"},
            **{name: {"DCPC_KERNEL_MASK": "1"} for name in ALIASES}}


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _recorded_errors() -> list[str]:
    """What the kernels of every cached combine module recorded (a timeout, a contract
    error), read after a scenario."""
    import torch

    from dcpc.engines import runners

    if DEV != "cpu":  # the ranks' streams done: with DCPC_TRAP=0 every wait is bounded
        torch.cuda.synchronize(DEV)
    found = []
    for key, run in runners.built():
        module = getattr(run, "module", None)
        try:
            if module is not None:
                module.check_errors()
        except Exception as exc:  # noqa: BLE001 - reported
            found.append(f"{key[2]} rank {key[5]}: {type(exc).__name__}: {exc}")
    return found


def _scenarios(world: int, say: Any) -> dict[str, Any]:
    """Every scenario at ``world`` on DEV, by name. The first scenario that raises (a
    rank's error, or a rank hung past the group's timeout) ends the run: its error is the
    result, the scenarios after it are not run (a hung rank's kernel may still spin).
    ``say(text)``: where the run is."""
    import time
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    from dcpc.runtime.local import LocalGroup

    handler = _Log()
    logging.getLogger("dcpc.engines").addHandler(handler)
    group = LocalGroup(world, DEV, timeout_s=240 if DEV == "cpu" else 90)
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    for name in CASES:
        before = len(handler.lines)
        try:
            out[name] = {"ranks": _run_case(group, name, world),
                         "logs": handler.lines[before:]}
        except Exception as exc:  # noqa: BLE001 - reported as the scenario's result
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        recorded = _recorded_errors() if DEV != "cpu" else []  # DCPC_TRAP=0: not trapped
        if recorded:
            before = out[name].get("error", "")
            out[name] = {"error": f"{before}\nrecorded by kernels: {recorded}".strip()}
        say(f"[{time.monotonic() - t0:6.1f}s] W={world} {name}: "
            f"{'error' if 'error' in out[name] else 'ran'}")
        if "error" in out[name]:
            break
    return out


def _child(world: int) -> None:
    """The child on a GPU (a process started from scratch: TRITON_INTERPRET=0): every
    scenario at ``world``, printed as one JSON line."""
    out = _scenarios(world, lambda text: print(text, file=sys.stderr, flush=True))
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # threads of a hung rank must not keep the process alive


def worker(rank: int, world: int, ranks: int) -> dict[str, Any]:
    """The child on CPU: a process forked from dcpc.harness.launch's fork server (torch
    and triton imported once), alone in its gloo group (``world`` 1); every scenario at
    ``ranks`` threads. The launcher kills it if a hung rank keeps it alive."""
    from dcpc.harness.launch import progress

    return _scenarios(ranks, progress)


# ---- the tests ----------------------------------------------------------------------------
_results: dict[int, Any] = {}


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _child_env(cache: str) -> dict[str, str]:
    # the interpreter on CPU only: on CUDA it would copy tensors to the host for
    # every kernel, and peers' stores through the pointer tables never arrive
    # DCPC_TRAP=0 on CUDA: a timed-out wait is recorded and reported per scenario
    # (a trap would end the child and every rank's record with it)
    env = {**os.environ, "TRITON_INTERPRET": "1" if DEV == "cpu" else "0",
           "DCPC_TRAP": "1" if DEV == "cpu" else "0",
           "OMP_NUM_THREADS": "1", "DCPC_CACHE_DIR": cache,
           "DCPC_MAX_NUM_TOKENS": str(WORKSPACE)}
    for var in ("VLLM_USE_DIRECT_DCP_A2A", "DCPC_VLLM_AG_RS", "DCPC_SGLANG",
                "DCPC_KERNEL_MASK",
                "VLLM_USE_DIRECT_DCP_Q_GATHER", "VLLM_USE_DIRECT_DCP_KV_GATHER",
                "DCPC_BACKEND"):
        env.pop(var, None)
    return env


def _run_child(world: int) -> Any:
    """One child process runs every scenario at ``world`` (its own module cache, its own
    process state: the adapters' tables and log-once records start empty)."""
    with tempfile.TemporaryDirectory(prefix="dcpc-engines-") as cache:
        env = _child_env(cache)
        if DEV == "cpu":  # from the fork server
            from dcpc.harness.launch import launch

            result = launch("test_engines_local:worker", 1, {"ranks": world}, timeout_s=600,
                            env=env)
            if result.ok:
                return result.values()[0]
            return {"child failed": result.summary() + "".join(
                o.traceback for o in result.outcomes)[-4000:]}
        try:
            proc = subprocess.run([sys.executable, __file__, str(world)],
                                  capture_output=True, text=True, timeout=600, env=env)
            stdout, stderr = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            stdout, stderr = _text(exc.stdout), _text(exc.stderr) + "\n(timed out)"
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    return (json.loads(lines[-1][len("RESULT "):]) if lines else
            {"child failed": stdout[-2000:] + stderr[-4000:]})


def _results_for(world: int) -> Any:
    if world not in _results:
        # kept on failure too: every test of this W reports the same run, which runs once
        _results[world] = _run_child(world)
    got = _results[world]
    assert "child failed" not in got, got.get("child failed")
    return got


def _case(world: int, case: str) -> Any:
    got = _results_for(world)
    if case not in got:
        failed = [f"{k}: {v['error']}" for k, v in got.items() if "error" in v]
        pytest.fail(f"{case} not run at W={world}: an earlier scenario failed ({failed})")
    assert "error" not in got[case], got[case]["error"]
    return got[case]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_adapter_matches_float64_reference(case: str, world: int) -> None:
    got = _case(world, case)
    assert len(got["ranks"]) == world
    for r, checks in enumerate(got["ranks"]):
        assert checks, f"rank {r} checked nothing"
        bad = [c for c in checks if not c["ok"]]
        assert not bad, (r, bad)


@pytest.mark.parametrize("world", [2, 3])
def test_over_workspace_falls_back_and_says_so(world: int) -> None:
    logs = _case(world, "vllm_over_workspace")["logs"]
    assert any("torch fallback" in x and "exceed the workspace" in x for x in logs), logs
    # logged once per reason, not once per rank or call
    assert len(logs) == len(set(logs)), logs


@pytest.mark.parametrize("world", [2, 3])
def test_fast_path_runs_without_fallback(world: int) -> None:
    """The masked, strided and repeated calls ran on dcpc modules: nothing was logged."""
    for case in ("vllm_a2a_mask", "vllm_ag_rs_mask", "vllm_repeat", "vllm_strided",
                 "vllm_ag_rs_strided", "sglang", "vllm_manager", "vllm_no_requests",
                 "kernel_mask_a2a", "kernel_mask_strided", "kernel_mask_manager", "vllm_helix"):
        logs = _case(world, case)["logs"]
        assert logs == [], (case, logs)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _child(int(sys.argv[1]))
