"""The adapters' CUDA-graph capture warm-up on ONE GPU: W ranks as threads (``local``).

    python3 -m benchmarks.capture_warm --out DIR [--worlds 2,4] [--sizes 1,2,4,8,16]
    python3 -m benchmarks.capture_warm --out DIR --dry    # CPU, Triton interpreter, no graphs

Per W: install() puts the vLLM and SGLang adapters over stand-in engine modules whose
configs name the capture sizes (vLLM: compilation_config.cudagraph_capture_sizes;
SGLang: server args' cuda_graph_bs); every rank then makes each function's FIRST call
(a size that is not a capture size, as the engines' dummy run) inside
``compile_only()`` (ranks share one CUDA context: nothing may compile while a peer's
kernel spins; dcpc.runtime.local), which runs the adapters' warm-up of every capture
size; then one eager pass at every size; then, per size, one CUDA graph per rank
holding every function's call, captured one rank after another (``rank.capture``);
each graph is replayed ``--replays`` times with new random inputs copied into the
captured ones, every result against float64 (bf16 tolerance 2e-2; NaN fails).

Counted: Triton compiles (``knobs.runtime.jit_post_compile_hook``) and dcpc's own
counters (dcpc.runtime.calls.COUNTS: new call plans, module allocations, schedule
compiles) in the eager pass and in the captures; both must be 0 (the exit code says).
Writes DIR/capture_warm.md and DIR/capture_warm.json. ``--dry``: CPU, the same flow
with eager calls in place of captures and replays (a smoke test of the script).
"""

from __future__ import annotations

import os
import sys

if "--dry" in sys.argv:  # before Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # before CUDA starts: see local.py
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

FUNCTIONS = ("vllm a2a", "vllm ag_rs", "manager combine", "manager q", "sglang a2a",
             "sglang q")
ATOL = 2e-2  # and rtol: bf16 outputs


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry", action="store_true", help="CPU, no CUDA graphs (smoke test)")
    ap.add_argument("--worlds", type=_ints, default=[2, 4])
    ap.add_argument("--sizes", type=_ints, default=[1, 2, 4, 8, 16])
    ap.add_argument("--first", type=int, default=3, help="the first call's tokens")
    ap.add_argument("--heads", type=int, default=16, help="all ranks' heads (H % W == 0)")
    ap.add_argument("--dv", type=int, default=512)
    ap.add_argument("--dq", type=int, default=576)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=540.0, help="per W, seconds")
    return ap.parse_args(argv)


# ---- stand-in engines ---------------------------------------------------------------------
class Standins:
    """vLLM 0.33.0's and 0.34.0's and SGLang 0.5.23's module paths and names; their own
    functions raise (the adapters' fallback must not be taken here)."""

    def __init__(self, sizes: list[int]):
        self.saved: dict[str, Any] = {}
        top = max(sizes)
        self.vllm_cfg = SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_capture_sizes=list(sizes),
                                               max_cudagraph_capture_size=top),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=top),
            speculative_config=None, num_speculative_tokens=0,
            parallel_config=SimpleNamespace(num_ubatches=1, dcp_comm_backend="a2a"))
        self.current: list[Any] = [self.vllm_cfg]
        self.server_args = SimpleNamespace(cuda_graph_bs=list(sizes), cuda_graph_max_bs=top,
                                           speculative_algorithm=None)

        def engine(name: str) -> Any:
            def own(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(f"the engine's own {name} ran (a fallback was taken)")
            own.__name__ = name
            return own

        def vllm_free(name: str) -> Any:
            def fn(cp_attn_out, cp_attn_lse, cp_group, ctx=None, return_lse=False,
                   is_lse_base_on_e=True, seq_lens=None, query_start_loc=None):
                return engine(name)()
            fn.__name__ = name
            return fn

        self._add("vllm.config", get_current_vllm_config_or_none=lambda: self.current[0])
        self._add("vllm.v1.attention.ops.dcp", MLADCPManager=type("MLADCPManager", (), {}),
                  **{n: vllm_free(n) for n in ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce",
                                               "cp_lse_ag_out_ar")})
        self._add("sglang.srt.server_args", get_global_server_args=lambda: self.server_args)
        self._add("sglang.srt.layers.dcp.comm", **{n: engine(n) for n in (
            "dcp_a2a_lse_reduce", "cp_lse_ag_out_rs_mla", "all_gather_q_for_mla_decode")})

    def _add(self, name: str, **attrs: Any) -> None:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            full = ".".join(parts[:i])
            if full not in self.saved:  # a stand-in package for every prefix
                self.saved[full] = sys.modules.get(full)
                sys.modules[full] = types.ModuleType(full)
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], sys.modules[full])
        vars(sys.modules[name]).update(attrs)

    def restore(self) -> None:
        for name, mod in self.saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


# ---- one rank -----------------------------------------------------------------------------
def _compile_counter() -> tuple[dict[str, int], Any]:
    """Triton compiles in this process (every in-memory cache miss), by a hook; and the
    function that takes the hook away."""
    from triton import knobs

    box = {"n": 0}
    lock = threading.Lock()
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args: Any, **kwargs: Any) -> Any:
        with lock:
            box["n"] += 1
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook

    def restore() -> None:
        knobs.runtime.jit_post_compile_hook = previous

    return box, restore


class Inputs:
    """Every rank's random inputs of one size (each rank makes all of them: the float64
    references need them) and the references of this rank."""

    def __init__(self, seed: int, n: int, w: int, a: argparse.Namespace, rank: int,
                 dev: torch.device):
        from dcpc.engines import reference as ref

        g = torch.Generator().manual_seed(seed)
        h, hl = a.heads, a.heads // w
        outs = [torch.randn(n, h, a.dv, generator=g).bfloat16() for _ in range(w)]
        lses = [torch.randn(n, h, generator=g) * 2 for _ in range(w)]
        lens = [torch.randint(0, 3, (n,), generator=g, dtype=torch.int32) for _ in range(w)]
        qsl = torch.arange(n + 1, dtype=torch.int32)
        qs = [torch.randn(n, hl, a.dq, generator=g).bfloat16() for _ in range(w)]
        self.mine = {"out": outs[rank], "lse": lses[rank], "lens": lens[rank], "qsl": qsl,
                     "q": qs[rank]}
        self.mine = {k: v.to(dev) for k, v in self.mine.items()}
        masked = ref.vllm_combine(outs, lses, local_lens=lens, qsl=qsl)[rank][0]
        plain = ref.vllm_combine(outs, lses)[rank][0]
        q = ref.gather_heads(qs)
        self.want = {"vllm a2a": masked, "vllm ag_rs": masked, "manager combine": masked,
                     "manager q": q, "sglang a2a": plain, "sglang q": q}


def _calls(x: dict[str, torch.Tensor], rank: Any, mgr: Any, a: argparse.Namespace
           ) -> dict[str, torch.Tensor]:
    """One call of every function (through the engines' rebound names), results cloned
    (results are views of module buffers, and two functions may share a module)."""
    vops = sys.modules["vllm.v1.attention.ops.dcp"]
    comm = sys.modules["sglang.srt.layers.dcp.comm"]
    split = 64 if a.dq > 64 else a.dq // 2
    nope, pe = comm.all_gather_q_for_mla_decode(x["q"][..., split:], x["q"][..., :split], rank)
    return {
        "vllm a2a": vops.dcp_a2a_lse_reduce(x["out"], x["lse"], rank, seq_lens=x["lens"],
                                            query_start_loc=x["qsl"]).clone(),
        "vllm ag_rs": vops.cp_lse_ag_out_rs(x["out"], x["lse"], rank, seq_lens=x["lens"],
                                            query_start_loc=x["qsl"]).clone(),
        "manager combine": mgr.combine(x["out"], x["lse"], seq_lens=x["lens"],
                                       query_start_loc=x["qsl"]).clone(),
        "manager q": mgr.query_gather(x["q"]).clone(),
        "sglang a2a": comm.dcp_a2a_lse_reduce(x["out"], x["lse"], rank).clone(),
        "sglang q": torch.cat([pe, nope], dim=-1).clone(),
    }


def _bad(got: torch.Tensor, want: torch.Tensor) -> tuple[int, float]:
    from dcpc.runtime.local import to_host

    g = to_host(got).double()
    err = (g - want).abs()
    bad = ~(err <= ATOL + ATOL * want.abs())  # NaN fails
    return int(bad.sum()), float(err.nan_to_num(float("inf")).max()) if err.numel() else 0.0


def rank_main(rank: Any, a: argparse.Namespace, st: Standins, compiles: dict[str, int]
              ) -> dict[str, Any]:
    import dcpc.engines.vllm as V
    from dcpc.engines import sglang as S
    from dcpc.engines import vllm_free as F
    from dcpc.runtime import calls
    from dcpc.runtime.local import compile_only, sync_stream

    w, r, dev = rank.world, rank.rank, rank.device
    cuda = dev.type == "cuda"
    rec: dict[str, Any] = {"rank": r, "rows": []}

    def counted(body: Any) -> dict[str, int]:
        rank.barrier()
        before = (calls.counts(), compiles["n"]) if r == 0 else None
        rank.barrier()
        body()
        rank.barrier()
        after = (calls.counts(), compiles["n"]) if r == 0 else None
        rank.barrier()
        if before is None:
            return {}
        got = {k: after[0][k] - before[0][k] for k in ("plans", "allocations", "compiles")}
        return {**got, "triton": after[1] - before[1]}

    def first_calls() -> None:  # the warm-up: each function's first call
        x = Inputs(7, a.first, w, a, r, dev).mine
        mgr = V.MLADCPManager(st.vllm_cfg, dev, a.heads // w, a.dq, a.dv, torch.bfloat16,
                              torch.bfloat16, group=rank, backend="local")
        holder.append(mgr)
        _calls(x, rank, mgr, a)
        sync_stream(dev)

    holder: list[Any] = []
    t0 = time.perf_counter()
    if cuda:
        with compile_only():
            warm = counted(first_calls)
    else:
        warm = counted(first_calls)
    rec["warm"] = {**warm, "seconds": round(time.perf_counter() - t0, 2)}
    mgr = holder[0]
    rec["workspace"] = {"vllm": F._free_tokens(), "sglang": S._tokens(),
                        "manager": mgr.max_num_tokens}

    # made before any call: a host-to-device copy while this rank's stream waits on a
    # peer can hang ranks as threads (dcpc.runtime.local.to_host)
    cases = [Inputs(11 + n, n, w, a, r, dev).mine for n in a.sizes for _ in range(2)]

    def eager() -> None:
        for x in cases:
            _calls(x, rank, mgr, a)
        sync_stream(dev)

    rec["eager"] = counted(eager)
    for n in a.sizes:
        static = Inputs(1000 + n, n, w, a, r, dev).mine
        static = {k: v.clone() for k, v in static.items()}
        graph = torch.cuda.CUDAGraph() if cuda else None
        outs: dict[str, torch.Tensor] = {}

        def capture(graph: Any = graph, outs: dict = outs, static: dict = static) -> None:
            if graph is None:
                outs.update(_calls(static, rank, mgr, a))
                return
            with rank.capture(graph):
                outs.update(_calls(static, rank, mgr, a))

        cap = counted(capture)
        bad = {f: 0 for f in FUNCTIONS}
        worst = {f: 0.0 for f in FUNCTIONS}
        for i in range(a.replays):
            case = Inputs(2000 + 17 * n + i, n, w, a, r, dev)
            for k, v in case.mine.items():
                static[k].copy_(v)
            if graph is not None:
                graph.replay()
            else:
                outs.update(_calls(static, rank, mgr, a))
            sync_stream(dev)
            for f in FUNCTIONS:
                b, e = _bad(outs[f], case.want[f])
                bad[f] += b
                worst[f] = max(worst[f], e)
            rank.barrier()
        rec["rows"].append({"size": n, "capture": cap, "bad": bad, "max_err": worst,
                            "graph": graph is not None})
        del graph
    return rec


def run_world(a: argparse.Namespace, w: int, compiles: dict[str, int]) -> dict[str, Any]:
    import logging

    from dcpc.engines import capture as C
    from dcpc.engines import combine
    from dcpc.engines import sglang as S
    from dcpc.engines import vllm as V
    from dcpc.engines import vllm_free as F
    from dcpc.runtime.local import LocalGroup

    st = Standins(a.sizes)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep = Keep(logging.INFO)
    log = logging.getLogger("dcpc.engines")
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    # what install() changes in this process, put back after (the smoke test runs in
    # pytest's process)
    saved = (dict(F._originals), list(F._installed_tokens), list(S._installed_tokens),
             dict(C._found))
    try:
        F._originals.clear()
        F._installed_tokens.clear()
        F._free_tokens.cache_clear()
        C.forget()
        V.forget_config()
        st.current[0] = None  # vLLM loads plugins with no config current: install()
        patched = V.install() + S.install()  # reads none; the manager's construction
        # (load_model) in rank_main is where the adapters first see vLLM's config
        dev = torch.device("cpu") if a.dry else torch.device("cuda", 0)
        group = LocalGroup(w, dev, timeout_s=a.timeout)
        recs = group.run(lambda rank: rank_main(rank, a, st, compiles), timeout_s=a.timeout)
    finally:
        combine.reset()
        log.removeHandler(keep)
        log.setLevel(level)
        st.restore()
        F._originals.clear()
        F._originals.update(saved[0])
        F._installed_tokens[:], S._installed_tokens[:] = saved[1], saved[2]
        V.forget_config()
        C._found.clear()
        C._found.update(saved[3])
    return {"world": w, "patched": patched, "ranks": recs,
            "log": [x for x in lines if "warm" in x or "install()" in x]}


def table(results: dict[str, Any]) -> str:
    out = [f"# CUDA-graph capture warm-up ({'dry: CPU, eager' if results['dry'] else 'one GPU'})",
           "", f"sizes {results['sizes']}, H {results['heads']}, Dv {results['dv']}, "
           f"Dq {results['dq']}, {results['replays']} replays per graph; functions: "
           f"{', '.join(FUNCTIONS)}", "",
           "| W | size | Triton compiles in capture | new plans | allocations | dcpc compiles "
           "| bad elements (all functions) | max error |", "| --- " * 8 + "|"]
    for world in results["worlds"]:
        r0 = world["ranks"][0]
        for row in r0["rows"]:
            c = row["capture"]
            bad = sum(sum(rr["rows"][i]["bad"].values()) for rr in world["ranks"]
                      for i, x in enumerate(rr["rows"]) if x["size"] == row["size"])
            err = max(max(x["max_err"].values()) for rr in world["ranks"] for x in rr["rows"]
                      if x["size"] == row["size"])
            out.append(f"| {world['world']} | {row['size']} | {c.get('triton')} | "
                       f"{c.get('plans')} | {c.get('allocations')} | {c.get('compiles')} | "
                       f"{bad} | {err:.3g} |")
    out += ["", "Warm-up (first calls, in compile_only on a GPU) and the eager pass after it:", ""]
    for world in results["worlds"]:
        r0 = world["ranks"][0]
        out.append(f"- W = {world['world']}: warm-up {r0['warm']}; eager pass {r0['eager']}; "
                   f"workspaces {r0['workspace']}")
        out += [f"  - {line}" for line in sorted(set(world["log"]))]
    out += ["", f"verdict: {'PASS' if results['ok'] else 'FAIL'}"]
    return "\n".join(out) + "\n"


def verdict(results: dict[str, Any]) -> bool:
    for world in results["worlds"]:
        if world["ranks"][0]["eager"].get("triton") or any(
                v for v in world["ranks"][0]["eager"].values()):
            return False
        for rr in world["ranks"]:
            for row in rr["rows"]:
                if any(row["bad"].values()) or any(row["capture"].values()):
                    return False
    return True


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not 0 < a.first <= max(a.sizes):
        print(f"--first {a.first} must be within the workspace (the largest size "
              f"{max(a.sizes)})", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry on CPU", file=sys.stderr)
        return 2
    made = None  # the compile cache's folder, when none is given: removed at the end
    if not os.environ.get("DCPC_CACHE_DIR"):
        made = os.environ["DCPC_CACHE_DIR"] = tempfile.mkdtemp(prefix="dcpc-capture-warm-")
    for name in ("DCPC_MAX_NUM_TOKENS", "DCPC_CAPTURE_SIZES", "DCPC_WARM_CAPTURE"):
        os.environ.pop(name, None)  # the sizes and workspaces come from the stand-in configs
    compiles, uncount = _compile_counter()
    results: dict[str, Any] = {"dry": a.dry, "sizes": a.sizes, "heads": a.heads, "dv": a.dv,
                               "dq": a.dq, "replays": a.replays, "worlds": [],
                               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "device": "cpu" if a.dry else torch.cuda.get_device_name(0)}
    try:
        for w in a.worlds:
            if a.heads % w:
                print(f"W={w}: {a.heads} heads do not split; skipped", file=sys.stderr)
                continue
            results["worlds"].append(run_world(a, w, compiles))
    finally:
        uncount()
        if made is not None:
            os.environ.pop("DCPC_CACHE_DIR", None)
            shutil.rmtree(made, ignore_errors=True)
    results["ok"] = verdict(results)
    text = table(results)
    (a.out / "capture_warm.json").write_text(json.dumps(results, indent=1, default=str))
    (a.out / "capture_warm.md").write_text(text)
    print(text)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
