"""Fill the adapters' module cache ahead of time, so a server's first request does not
compile (docs/engines.md, "Filling the cache ahead of time").

The adapters (dcpc.engines.vllm, .sglang) build each schedule from the engine's dims
and look its module up in ``DCPC_CACHE_DIR`` (default ``~/.cache/dcpc/engines``) under
``cache_key``: the sha256 of the schedule's YAML (which names dcpc's version) and of the
code generator's sources (dcpc.engines.common). ``dcpc compile`` names its output after
the schedule, not this key, so it does not fill this cache; this module builds the
same specs the adapters build and compiles them into the cache folder:

    python -m dcpc.engines.warm --engine vllm --max-tokens 512 --dv 512 --dq 576

Run it with the dcpc the servers run (same version and sources: the key covers the
generator) and ship the folder, or point DCPC_CACHE_DIR at a shared one. It compiles
on CPU (no GPU, no process group); Triton's own kernel cache (GPU code, keyed by GPU
and Triton version) is separate and filled by the first launch on a GPU.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from dcpc.engines import common
from dcpc.engines.common import (
    PATHS,
    CombineSpec,
    GatherSpec,
    cache_dir,
    cache_key,
    module_class,
    schedule_text,
)

ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class Warmed:
    spec: CombineSpec | GatherSpec
    path: Path
    seconds: float
    compiled: bool  # False: it was in the cache already


def specs(engine: str, max_tokens: int, *, dv: int = 512, dq: int | None = 576,
          dtypes: tuple[str, ...] = ("bf16",), lse_bases: tuple[str, ...] = ("e",),
          paths: tuple[str, ...] = ("fused", "ag_rs"), slots: tuple[int, ...] = (1,),
          kernel_mask: bool = False, kv_width: int | None = None,
          kv_tokens: int | None = None, world: int = 2) -> list[CombineSpec | GatherSpec]:
    """The specs the adapters of ``engine`` build for these dims, as combine_call and
    the gathers build them: the combine of each path, dtype, LSE base and slot count
    (the workspace ``max_tokens``; requests up to ``max_tokens``; masked in-kernel
    only with DCPC_KERNEL_MASK=1, ``kernel_mask``), the query gather of width ``dq``
    and, for vLLM's manager, the KV gather of width ``kv_width`` for
    ``init_kv_gather(..., max_gathered_tokens=kv_tokens)`` at group size ``world``."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise ValueError(f"paths must be among {PATHS}, not {bad}")
    out: list[CombineSpec | GatherSpec] = []
    for dtype in dtypes:
        for n in slots:
            out += [CombineSpec(p, dv, o_dtype=dtype, out_dtype=dtype, lse_base=b,
                                max_tokens=max_tokens, max_reqs=max_tokens, slots=n,
                                mask=kernel_mask) for p in paths for b in lse_bases]
            if dq is not None:
                out.append(GatherSpec("q", dq, dtype, max_tokens, n))
            if engine == "vllm" and kv_width is not None and kv_tokens is not None:
                out.append(GatherSpec("kv", kv_width, dtype, kv_tokens // world, n))
    return out


def warm(wanted: list[CombineSpec | GatherSpec], world: int = 2) -> list[Warmed]:
    """Compile every spec into the cache folder (those already there are only
    imported); the file and the seconds each took."""
    done = []
    for spec in wanted:
        text = schedule_text(spec, world)
        path = cache_dir() / f"{cache_key(text)[:32]}.py"
        compiled = not path.exists()
        start = time.perf_counter()
        if compiled:  # into the folder even when this process already holds the class
            common.compile_into(text, path, world)
        module_class(spec, world)
        done.append(Warmed(spec, path, time.perf_counter() - start, compiled))
    return done


def _csv(kind: type, text: str) -> tuple:
    return tuple(kind(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcpc.engines.warm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--max-tokens", type=int, required=True,
                   help="the workspace in tokens: install(max_num_tokens=) or "
                        "DCPC_MAX_NUM_TOKENS (vLLM: get_dcp_workspace_max_num_tokens)")
    p.add_argument("--dv", type=int, default=512, help="output head dim (MLA: 512)")
    p.add_argument("--dq", type=int, default=576, help="query head dim (MLA: 576); 0: none")
    p.add_argument("--dtypes", default="bf16", help="comma-separated: bf16,f16,f32,fp8e4m3")
    p.add_argument("--lse-bases", default="e", help="comma-separated: e,2")
    p.add_argument("--paths", default="fused,ag_rs", help="comma-separated: fused,ag_rs,a2a")
    p.add_argument("--slots", default="1", help="comma-separated DBO slot counts: 1,2")
    p.add_argument("--kernel-mask", action="store_true", help="as DCPC_KERNEL_MASK=1")
    p.add_argument("--kv-width", type=int, default=None, help="KV row width (MLA: 576)")
    p.add_argument("--kv-tokens", type=int, default=None, help="max_gathered_tokens")
    p.add_argument("--world", type=int, default=2, help="the DCP group size (KV gather)")
    a = p.parse_args(argv)
    wanted = specs(a.engine, a.max_tokens, dv=a.dv, dq=a.dq or None,
                   dtypes=_csv(str, a.dtypes), lse_bases=_csv(str, a.lse_bases),
                   paths=_csv(str, a.paths), slots=_csv(int, a.slots),
                   kernel_mask=a.kernel_mask, kv_width=a.kv_width, kv_tokens=a.kv_tokens,
                   world=a.world)
    print(f"cache folder: {cache_dir()}")
    for w in warm(wanted, a.world):
        what = "compiled" if w.compiled else "cached  "
        print(f"{what} {w.seconds:7.2f} s  {w.path.name}  {w.spec}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
