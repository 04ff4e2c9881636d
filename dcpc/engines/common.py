"""What the vLLM and SGLang adapters share: schedules built from an engine's dims,
compiled once into a cache folder, the DCP group, env switches and the torch fallback.

An adapter describes what it needs as a ``CombineSpec`` (the output/LSE combine: path
a2a, fused or ag_rs) or a ``GatherSpec`` (the query all-gather, the KV all-gather);
``module_class(spec)`` writes the schedule's YAML, runs dcpc's full pipeline on it (the
structural check and the race/deadlock proof, as ``dcpc compile``), writes the module
into the cache folder (``DCPC_CACHE_DIR``, default ``~/.cache/dcpc/engines``) under the
sha256 of the YAML and of the code generator (templates, codegen sources), and imports
it. A later process imports the cached file without compiling (no pydantic needed then).

Every schedule here is W-independent (``H: {multiple_of: W}``); the text names the group
sizes it is checked for and dcpc's version, so the cache key covers them (a checkout
whose templates changed without a version change must clear the cache).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcpc import __version__
from dcpc.lang.mesh import DEFAULT_WORLDS
from dcpc.runtime import calls
from dcpc.runtime.backend import group_rank_world
from dcpc.runtime.errors import DcpcArgumentError
from dcpc.runtime.loading import import_file, schedule_class

log = logging.getLogger("dcpc.engines")

# dtype names of the schedule language, by torch dtype (what the adapters accept)
DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "fp8e4m3",
}
PATHS = ("a2a", "fused", "ag_rs")
# every schedule is proved for the W dcpc check proves by default (2..8), or up to the
# group's W
CHECKED_WORLDS = (DEFAULT_WORLDS[0], DEFAULT_WORLDS[-1])


# ---- the schedules ------------------------------------------------------------------------
@dataclass(frozen=True)
class CombineSpec:
    """The combine of partial attention outputs over the DCP group.

    ``path``: ``a2a`` (out_exchange + merge), ``fused`` (one all_to_all_combine launch)
    or ``ag_rs`` (all-gather LSE, correct in fp32, reduce-scatter in fp32). ``mask``:
    empty shards and padding rows are masked in-kernel from every rank's local KV
    lengths, which a first ``lens_gather`` step collects (an engine passes only its own;
    the adapters mask at the source unless DCPC_KERNEL_MASK=1: see
    dcpc.engines.combine.kernel_mask). ``out_dtype`` fp8e4m3 adds an ``output_scale``
    input (dst = clamp(x / scale))."""

    path: str
    dv: int
    o_dtype: str = "bf16"
    out_dtype: str = "bf16"
    lse_base: str = "e"
    max_tokens: int = 512
    max_reqs: int = 512
    slots: int = 1
    return_lse: bool = True
    mask: bool = True


@dataclass(frozen=True)
class GatherSpec:
    """An all-gather of rows over the DCP group into a module buffer, then the engine's
    read of it, then a barrier that closes the call (peers may overwrite the buffer
    only after every rank's read). ``dim`` 1: the query [T, H/W, D] -> [T, H, D];
    ``dim`` 0: KV rows [N, D] -> [W*N, D], rank-major (all_gather_into_tensor order)."""

    kind: str  # "q" | "kv"
    d: int
    dtype: str = "bf16"
    max_tokens: int = 512
    slots: int = 1


def _sizes(max_tokens: int, max_reqs: int | None, extra: dict[str, int]) -> list[str]:
    lines = ["sizes:", f"  T: {{max: {max_tokens}}}"]
    if max_reqs is not None:
        lines.append(f"  B: {{max: {max_reqs}}}")
    lines.append("  H: {multiple_of: W}")
    lines += [f"  {k}: {v}" for k, v in extra.items()]
    return lines


def _combine_body(s: CombineSpec) -> list[str]:
    base, odt = s.lse_base, s.o_dtype
    buf = [
        "buffers:",
        f"  o_part:   {{shape: [T, H, Dv], dtype: {odt}}}",
        f"  lse_part: {{shape: [T, H], dtype: f32, lse_base: {base}}}",
        f"  out:      {{shape: [T, H/W, Dv], dtype: {s.out_dtype}}}",
    ]
    steps = ["steps:"]
    extra = ""
    if s.mask:
        buf += [
            "  lens_local: {shape: [B], dtype: i32}",
            "  lens_all: {shape: [B, W], dtype: i32, symmetric: true}",
            "  query_start_loc: {shape: [B+1], dtype: i32}",
        ]
        steps.append("  - lens_gather: {op: all_gather, src: lens_local, dst: lens_all, dim: 1}")
        extra += ", mask_empty: {local_seq_lens: lens_all, query_start_loc: query_start_loc}"
    if s.out_dtype == "fp8e4m3":
        buf.append("  out_scale: {shape: [1], dtype: f32}")
        extra_scale = ", output_scale: out_scale"
    else:
        extra_scale = ""
    if s.path in ("a2a", "fused"):
        buf += [
            f"  o_recv:   {{shape: [W, T, H/W, Dv], dtype: {odt}, symmetric: true}}",
            f"  lse_recv: {{shape: [W, T, H/W], dtype: f32, symmetric: true, lse_base: {base}}}",
        ]
        if s.return_lse:
            buf.append(f"  out_lse: {{shape: [T, H/W], dtype: f32, lse_base: {base}}}")
            extra += ", return_lse: out_lse"
        if s.path == "a2a":
            steps += [
                "  - out_exchange: {op: all_to_all, src: [o_part, lse_part], "
                "dst: [o_recv, lse_recv], dim: 1}",
                f"  - merge: {{op: lse_combine, src: [o_recv, lse_recv], dst: out"
                f"{extra}{extra_scale}}}",
            ]
        else:
            steps.append(
                "  - combine: {op: all_to_all_combine, src: [o_part, lse_part], "
                f"via: [o_recv, lse_recv], dst: out, dim: 1{extra}{extra_scale}}}")
        # a fast peer's next exchange would write o_recv/lse_recv (and lens_all) while
        # this rank still merges: the barrier closes the call (see release())
        steps.append("  - release: {op: barrier}")
    else:
        buf += [
            f"  lse_all: {{shape: [W, T, H], dtype: f32, symmetric: true, lse_base: {base}}}",
            "  o_corr: {shape: [T, H, Dv], dtype: f32}",
            "  o_rs_recv: {shape: [W, T, H/W, Dv], dtype: f32, symmetric: true}",
        ]
        if s.return_lse:
            buf.append(f"  lse_full: {{shape: [T, H], dtype: f32, lse_base: {base}}}")
            extra += ", return_lse: lse_full"
        steps += [
            "  - lse_gather: {op: all_gather, src: lse_part, dst: lse_all, dim: 0}",
            f"  - correct: {{op: lse_correct, src: [o_part, lse_all], dst: o_corr{extra}}}",
            "  - out_scatter: {op: reduce_scatter, src: o_corr, dst: out, dim: 1, "
            f"via: o_rs_recv{extra_scale}}}",
        ]
    return _sizes(s.max_tokens, s.max_reqs if s.mask else None, {"Dv": s.dv}) + buf + steps


def _gather_body(s: GatherSpec) -> list[str]:
    if s.kind == "q":
        shapes, dim = ("[T, H/W, D]", "[T, H, D]"), 1
        sizes = _sizes(s.max_tokens, None, {"D": s.d})
    else:
        shapes, dim = ("[T, D]", "[W*T, D]"), 0
        sizes = ["sizes:", f"  T: {{max: {s.max_tokens}}}", f"  D: {s.d}"]
    return sizes + [
        "buffers:",
        f"  rows_local: {{shape: {shapes[0]}, dtype: {s.dtype}}}",
        f"  rows_full:  {{shape: {shapes[1]}, dtype: {s.dtype}, symmetric: true}}",
        "steps:",
        f"  - gather: {{op: all_gather, src: rows_local, dst: rows_full, dim: {dim}}}",
        "  - use: {op: external, reads: [rows_full]}",
        "  - release: {op: barrier}",
    ]


def schedule_text(spec: CombineSpec | GatherSpec, world: int = 2) -> str:
    """The schedule's YAML for ``spec``, proved for W 2..max(8, world)."""
    _check_spec(spec)
    if isinstance(spec, CombineSpec):
        kind, body = f"combine_{spec.path}", _combine_body(spec)
    else:
        kind, body = f"gather_{spec.kind}", _gather_body(spec)
    top = max(CHECKED_WORLDS[1], world)
    head = [  # the version is in the key: another dcpc may emit another module
        f"# dcpc {__version__} engines: checked for W {CHECKED_WORLDS[0]}..{top}",
        f"slots: {spec.slots}",
    ]
    text = "\n".join(head + body) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"schedule: dcpc_{kind}_{digest}\n" + text


def _check_spec(spec: CombineSpec | GatherSpec) -> None:
    if isinstance(spec, CombineSpec):
        if spec.path not in PATHS:
            raise DcpcArgumentError(f"path must be one of {PATHS}, not {spec.path!r}")
        if spec.lse_base not in ("e", "2"):
            raise DcpcArgumentError(f"lse_base must be 'e' or '2', not {spec.lse_base!r}")
        if spec.slots not in (1, 2):
            raise DcpcArgumentError(f"slots (microbatches) must be 1 or 2, not {spec.slots}")
    elif spec.kind not in ("q", "kv"):
        raise DcpcArgumentError(f"gather kind must be 'q' or 'kv', not {spec.kind!r}")


# ---- compile once, cache, import ----------------------------------------------------------
_lock = threading.Lock()
_classes: dict[str, type] = {}


def cache_key(text: str) -> str:
    """The cache key of a schedule's module: sha256 of its YAML and of the generator."""
    return hashlib.sha256((text + _generator()).encode()).hexdigest()


def _generator() -> str:
    """The code generator's fingerprint, when this install has the compiler's sources
    (always in a checkout or a wheel of dcpc; the import needs no pydantic)."""
    from dcpc.codegen.templates import generator_fingerprint

    return generator_fingerprint()


def cache_dir() -> Path:
    """Where compiled modules live: ``DCPC_CACHE_DIR`` or ``~/.cache/dcpc/engines``."""
    return Path(os.environ.get("DCPC_CACHE_DIR") or Path.home() / ".cache/dcpc/engines")


def module_class(spec: CombineSpec | GatherSpec, world: int = 2) -> type:
    """The generated class for ``spec``: from this process's table, else the cache
    folder, else compiled now (the full check) and written atomically."""
    text = schedule_text(spec, world)
    key = cache_key(text)
    with _lock:
        if key not in _classes:
            path = cache_dir() / f"{key[:32]}.py"
            if not path.exists():
                compile_into(text, path, world)
                calls.count("compiles")
            _classes[key] = schedule_class(import_file(path, f"dcpc_engines_{key[:16]}"))
            calls.count("imports")
        return _classes[key]


def compile_into(text: str, path: Path, world: int) -> None:
    """Run dcpc's pipeline (parse .. hb .. emit) on ``text``; write the module to ``path``
    through a temporary file and os.replace (a concurrent rank sees all or nothing)."""
    from dcpc.diagnostics import DiagnosticError
    from dcpc.pipeline import Options, run

    path.parent.mkdir(parents=True, exist_ok=True)
    worlds = tuple(range(CHECKED_WORLDS[0], max(CHECKED_WORLDS[1], world) + 1))
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".dcpc-") as tmp:
        source = Path(tmp) / "schedule.yaml"
        source.write_text(text)
        try:
            c = run(source, Options(worlds=worlds))
        except DiagnosticError as err:
            raise RuntimeError(f"dcpc.engines: the generated schedule does not check "
                               f"(a dcpc bug):\n{err}\n{text}") from None
        _write_atomic(path.with_suffix(".yaml"), text)  # for people reading the cache
        _write_atomic(path, c.module_text)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".dcpc-", suffix=path.suffix)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---- the group ----------------------------------------------------------------------------
@dataclass
class Group:
    """The DCP group as dcpc sees it: what modules are built on (``handle``: a torch
    ProcessGroup or a dcpc LocalRank), this rank, the size, and the device."""

    handle: Any
    rank: int
    world: int
    device: torch.device


def resolve_group(group: Any, device: torch.device) -> Group:
    """What engines pass as the DCP group: a vLLM/SGLang GroupCoordinator (its
    device_group on CUDA, its cpu_group on CPU when it has one), any object with a
    ``device_group`` (vLLM's own tests pass one with ``world_size`` and ``device_group``
    only), a torch ProcessGroup, or a dcpc LocalRank. The object's ``world_size`` and
    ``rank_in_group``, where it has them, must agree with its process group's."""
    handle = group
    if hasattr(group, "device_group"):
        cpu = getattr(group, "cpu_group", None)
        handle = group.device_group if device.type == "cuda" or cpu is None else cpu
    try:
        rank, world = group_rank_world(handle)
    except (TypeError, ValueError, RuntimeError) as err:
        raise DcpcArgumentError(
            f"group: {type(group).__name__} is not a DCP group dcpc can use ({err}); pass "
            "a GroupCoordinator, an object with device_group (a ProcessGroup), a "
            "ProcessGroup, or a dcpc LocalRank") from None
    declared = (getattr(group, "rank_in_group", rank), getattr(group, "world_size", world))
    if handle is not group and declared != (rank, world):
        raise DcpcArgumentError(
            f"group: rank_in_group/world_size {declared[0]}/{declared[1]} "
            f"differ from its process group's {rank}/{world}")
    return Group(handle, rank, world, device)


# ---- installing over an engine's functions -------------------------------------------------
def rebind(name: str, old: Any, new: Any) -> list[str]:
    """Point every imported module's global ``name`` that is ``old`` at ``new`` (the
    engine's defining module and every ``from ... import`` binding); the modules changed.
    Reads module namespaces directly: a lazy module's ``__getattr__`` is never run."""
    changed = []
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):  # None placeholders, other objects
            continue
        namespace = vars(module)
        if namespace.get(name) is old:
            namespace[name] = new
            changed.append(f"{getattr(module, '__name__', '?')}.{name}")
    return changed


# ---- switches and logging -----------------------------------------------------------------
def switch(name: str) -> str:
    """A tri-state env switch: unset -> "auto", "1"/true -> "on", "0"/false -> "off"."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return "auto"
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return "on"
    if v in ("0", "false", "no", "off"):
        return "off"
    raise DcpcArgumentError(f"{name}={value!r}: use 1 (force), 0 (off) or leave it unset")


_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(key: str, message: str) -> None:
    """A fallback is logged once per reason and process, not once per layer or rank."""
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    log.warning(message)
