"""The released vLLM and SGLang wheels, fetched once and opened without installing them:
the pins, the download into a cache folder, the extraction of the few files the tests
load, and a loader that puts those files into ``sys.modules`` under their real names
beside the smallest set of named stubs (tests/engines/test_engines_wheels.py says which and why),
and that can transplant a class's methods from a wheel file (the MLA layer's weight
loading and decode path) to run them with named stand-ins for what needs CUDA.

The pins live here and nowhere else. A missing wheel is downloaded with
``python -m pip download --no-deps NAME==VERSION`` into ``$DCPC_WHEEL_CACHE`` (default
``~/.cache/dcpc/wheels``) and reused from there. When that fails the test FAILS naming
the command, unless ``DCPC_SKIP_ENGINE_WHEELS=1`` (then it skips, saying so)."""

from __future__ import annotations
import __future__

import ast
import builtins
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import types
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

# the released wheels tested (one place): every vLLM release the adapters support
PINS = {"vllm": ("0.33.0", "0.34.0"), "sglang": ("0.5.23",)}
SKIP_ENV = "DCPC_SKIP_ENGINE_WHEELS"


def cache_dir() -> Path:
    return Path(os.environ.get("DCPC_WHEEL_CACHE") or Path.home() / ".cache/dcpc/wheels")


def _download_command(name: str, version: str, into: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
            "-q", f"{name}=={version}", "-d", str(into or cache_dir())]


def wheel(name: str, version: str | None = None) -> Path:
    """The pinned wheel of ``name`` (its newest pin unless ``version``) in the cache,
    downloaded when missing."""
    version = version or PINS[name][-1]
    if version not in PINS[name]:
        raise ValueError(f"{name} {version} is not pinned ({', '.join(PINS[name])})")
    folder = cache_dir()
    found = sorted(folder.glob(f"{name}-{version}-*.whl"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = _download_command(name, version)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # then one rename: a test
        try:  # running beside this one never sees half a wheel
            done = subprocess.run(_download_command(name, version, Path(tmp)),
                                  capture_output=True, text=True, timeout=600)
            why = done.stderr.strip().splitlines()[-1:] if done.returncode else []
        except (OSError, subprocess.TimeoutExpired) as err:
            why = [f"{type(err).__name__}: {err}"]
        for got in Path(tmp).glob(f"{name}-{version}-*.whl"):
            os.replace(got, folder / got.name)
    found = sorted(folder.glob(f"{name}-{version}-*.whl"))
    if found:
        return found[0]
    message = (f"the {name} {version} wheel is not in {folder} and could not be downloaded "
               f"({'; '.join(why) or 'no wheel written'}): run "
               f"`{' '.join(cmd[:5])} {name}=={version} -d {folder}` with network "
               f"access, or set {SKIP_ENV}=1 to skip the tests against the real wheels")
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: {message}")
    pytest.fail(message, pytrace=False)


def extract(name: str, members: Iterable[str], version: str | None = None) -> Path:
    """Only ``members`` of the pinned wheel, into ``<cache>/src/<wheel>/`` (reused)."""
    whl = wheel(name, version)
    root = cache_dir() / "src" / whl.stem
    missing = [m for m in members if not (root / m).is_file()]
    if missing:
        with zipfile.ZipFile(whl) as z:
            for member in missing:  # written whole, then renamed (tests may run at once)
                target = root / member
                target.parent.mkdir(parents=True, exist_ok=True)
                part = target.with_name(f"{target.name}.{os.getpid()}.part")
                part.write_bytes(z.read(member))
                os.replace(part, target)
    return root


class WheelModules:
    """Modules put into sys.modules under their real names, removed again by close():

    - ``real(name)``: the wheel's own file, executed as module ``name``;
    - ``part(name, names)``: only the named top-level definitions of the wheel's file
      (with the file's imports they use), where the rest of the file cannot import;
    - ``shell(name, source)``: only the file's ``from SOURCE import ...`` statements, so
      the module holds exactly the bindings its real import of SOURCE makes;
    - ``stub(name, why, **attrs)``: a stand-in, recorded with its reason;
    - parent packages are empty (their ``__init__`` is not run) with an empty
      ``__path__``: an import this loader did not provide fails, never finds a file."""

    def __init__(self, root: Path):
        self.root = root
        self.added: list[str] = []
        self.stubs: dict[str, str] = {}
        self.stand_ins: dict[str, dict[str, str]] = {}  # module -> {global: why}

    def _file(self, name: str) -> Path:
        base = self.root / name.replace(".", "/")
        init = base / "__init__.py"
        return init if init.is_file() else base.with_suffix(".py")

    def _put(self, module: types.ModuleType) -> types.ModuleType:
        name = module.__name__
        parent, _, leaf = name.rpartition(".")
        if parent:
            self.package(parent)
        if name not in sys.modules:
            self.added.append(name)
        sys.modules[name] = module
        if parent:
            setattr(sys.modules[parent], leaf, module)
        return module

    def package(self, name: str) -> types.ModuleType:
        if name in sys.modules:
            return sys.modules[name]
        module = types.ModuleType(name)
        module.__path__ = []
        return self._put(module)

    def real(self, name: str) -> types.ModuleType:
        path = self._file(name)
        is_pkg = path.name == "__init__.py"
        spec = importlib.util.spec_from_file_location(
            name, path, submodule_search_locations=[] if is_pkg else None)
        module = importlib.util.module_from_spec(spec)
        self._put(module)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module

    def part(self, name: str, names: Iterable[str]) -> types.ModuleType:
        path = self._file(name)
        tree = ast.parse(path.read_text(), str(path))
        wanted = set(names)
        engine = name.partition(".")[0]
        keep, found = [], set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in wanted:
                found.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                hit = {t.id for t in targets if isinstance(t, ast.Name)} & wanted
                if not hit:
                    continue
                found |= hit
            elif isinstance(node, ast.Import):  # the file's own imports, not the engine's
                if any(a.name.partition(".")[0] == engine for a in node.names):
                    continue
            elif not (isinstance(node, ast.ImportFrom) and node.level == 0
                      and (node.module or "").partition(".")[0] != engine):
                continue
            keep.append(node)
        if found != wanted:
            raise LookupError(f"{path} defines no {sorted(wanted - found)}")
        module = types.ModuleType(name)
        module.__file__ = str(path)
        self._put(module)
        code = compile(ast.Module(keep, []), str(path), "exec")
        exec(code, module.__dict__)
        self.stubs[name] = f"only {', '.join(sorted(wanted))} (the wheel's source)"
        return module

    def shell(self, name: str, source: str) -> types.ModuleType:
        path = self._file(name)
        tree = ast.parse(path.read_text(), str(path))
        imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == source]
        if not imports:
            raise LookupError(f"{path} has no top-level `from {source} import`")
        module = types.ModuleType(name)
        module.__file__ = str(path)
        self._put(module)
        exec(compile(ast.Module(imports, []), str(path), "exec"), module.__dict__)
        self.stubs[name] = f"only its `from {source} import` (the wheel's statement)"
        return module

    def transplant(self, name: str, functions: Iterable[str] = (),
                   classes: Mapping[str, Iterable[str]] | None = None,
                   stand_ins: Mapping[str, tuple[Any, str]] | None = None
                   ) -> types.ModuleType:
        """The wheel file ``name``'s top-level ``functions`` and, of each class in
        ``classes``, the listed methods (in a class of that name without its bases: the
        test sets the attributes an instance needs), compiled from the wheel's source
        into module ``name`` (the shell() already there, or a new one), beside the file's
        own imports that are not the engine's and import here; ``stand_ins`` {global:
        (value, why)} provide the other names they use (recorded in ``stand_ins``). A
        name nothing provides raises NameError where the code reaches it. Annotations
        are not evaluated (as under ``from __future__ import annotations``)."""
        path = self._file(name)
        tree = ast.parse(path.read_text(), str(path))
        engine = name.partition(".")[0]
        methods_of = {k: set(v) for k, v in (classes or {}).items()}
        wanted = set(functions) | {f"{c}.{m}" for c, ms in methods_of.items() for m in ms}
        module = sys.modules.get(name) if name in self.added else None
        if module is None:
            module = types.ModuleType(name)
            module.__file__ = str(path)
            self._put(module)
        ns = module.__dict__
        ns.setdefault("__builtins__", builtins)
        body: list[ast.stmt] = []
        found: set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if getattr(node, "level", 0) or (mod or "").partition(".")[0] in (
                        engine, "__future__"):
                    continue
                try:  # the file's own imports; one that is not installed here (tqdm) is
                    exec(compile(ast.Module([node], []), str(path), "exec"), ns)
                except ImportError:  # only reached by code paths no test runs
                    continue
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name in functions:
                body.append(node)
                found.add(node.name)
            elif isinstance(node, ast.ClassDef) and node.name in methods_of:
                kept = [m for m in node.body if isinstance(m, (ast.FunctionDef,
                        ast.AsyncFunctionDef)) and m.name in methods_of[node.name]]
                found |= {f"{node.name}.{m.name}" for m in kept}
                body.append(ast.copy_location(ast.ClassDef(
                    name=node.name, bases=[], keywords=[], body=kept, decorator_list=[]),
                    node))
        if found != wanted:
            raise LookupError(f"{path} defines no {sorted(wanted - found)}")
        for key, (value, why) in (stand_ins or {}).items():
            ns[key] = value
            self.stand_ins.setdefault(name, {})[key] = why
        exec(compile(ast.fix_missing_locations(ast.Module(body, [])), str(path), "exec",
                     flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
        shell = self.stubs.get(name, "")
        self.stubs[name] = (f"{shell}; " if shell else "") + (
            f"the wheel's {', '.join(sorted(wanted))} with stand-ins for "
            f"{', '.join(sorted(self.stand_ins.get(name, {})))}")
        return module

    def stub(self, name: str, why: str, **attrs: Any) -> types.ModuleType:
        module = sys.modules.get(name) if name in self.added else None
        if module is None:
            module = types.ModuleType(name)
            self._put(module)
        module.__dict__.update(attrs)
        self.stubs[name] = why
        return module

    def close(self) -> None:
        for name in reversed(self.added):
            sys.modules.pop(name, None)
        self.added.clear()


# ---- the group the engines' code is handed ------------------------------------------------
class Coordinator:
    """A stand-in for vLLM's/SGLang's GroupCoordinator over one rank of a dcpc LocalGroup:
    the attributes and collectives the engines' DCP code calls (``world_size``,
    ``rank_in_group``, ``device_group``/``cpu_group``, ``all_gather(t, dim)``,
    ``all_reduce``, ``reduce_scatter(t, dim)``), computed with dcpc's threads' exchange
    (dcpc.engines.fallback.Comm) where the real one runs NCCL."""

    def __init__(self, rank: Any):
        import torch

        from dcpc.engines.common import resolve_group
        from dcpc.engines.fallback import Comm

        self.world_size, self.rank_in_group = rank.world, rank.rank
        self.device_group = self.cpu_group = rank
        self.gathers = 0
        self._comm = Comm(resolve_group(rank, torch.device("cpu")))

    def all_gather(self, t: Any, dim: int = -1) -> Any:
        import torch

        self.gathers += 1
        return torch.cat(list(self._comm.all_gather(t).unbind(0)), dim=dim)

    def all_reduce(self, t: Any) -> Any:
        return self._comm.all_reduce(t)

    def reduce_scatter(self, t: Any, dim: int = -1) -> Any:
        part = t.shape[dim] // self.world_size
        return self.all_reduce(t).narrow(dim, self.rank_in_group * part, part).contiguous()


_current = threading.local()


def current_group() -> Coordinator:
    """The Coordinator of this thread (the engines' ``get_dcp_group()``)."""
    group = getattr(_current, "group", None)
    if group is None:
        raise RuntimeError("get_dcp_group(): no DCP group in this thread (the test sets one)")
    return group


def set_group(rank: Any) -> Coordinator:
    _current.group = Coordinator(rank)
    return _current.group


class _Platform:
    """vllm.platforms.current_platform on a machine without an accelerator."""

    device_type = "cpu"

    def is_cuda(self) -> bool:
        return False

    is_rocm = is_cuda_alike = is_xpu = is_tpu = is_cpu_only = is_cuda

    def log_warnings(self) -> None:
        pass

    def fp8_dtype(self) -> Any:
        import torch

        return torch.float8_e4m3fn


# ---- vLLM (0.33.0, 0.34.0) -----------------------------------------------------------------
VLLM_DCP = "vllm.v1.attention.ops.dcp"
VLLM_REAL = (  # executed from the wheel, in this order
    "vllm.envs", "vllm.logging_utils.formatter", "vllm.logging_utils.lazy",
    "vllm.logging_utils.log_time", "vllm.logging_utils.torch_tensor",
    "vllm.logging_utils.uvicorn_logging", "vllm.logging_utils", "vllm.logger",
    "vllm.utils.math_utils", "vllm.triton_utils.importing",
    "vllm.triton_utils.tensor_descriptor", "vllm.triton_utils",
    "vllm.model_executor.warmup.jit_warmup",
    "vllm.model_executor.warmup.jit_warmup_triton_helper",
    "vllm.v1.attention.ops.cp_common", VLLM_DCP, "vllm.plugins")
VLLM_PARTS = {"vllm.v1.attention.backend": ("max_decode_query_len",),
              "vllm.v1.worker.ubatching": ("_THREAD_ID_TO_CONTEXT", "dbo_current_ubatch_id")}
VLLM_IMPORTERS = (  # every module of the wheel with `from vllm.v1.attention.ops.dcp import`
    "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.flashinfer",
    "vllm.model_executor.layers.attention.mla_attention",
    "vllm.model_executor.layers.attention.sparse_mla_attention",
    "vllm.models.kimi_k3.nvidia.mla")


def _member(name: str, root_has_pkg: set[str]) -> str:
    path = name.replace(".", "/")
    return f"{path}/__init__.py" if name in root_has_pkg else f"{path}.py"


VLLM_PACKAGES = {"vllm.logging_utils", "vllm.triton_utils", "vllm.plugins"}


def load_vllm(version: str | None = None) -> WheelModules:
    """vLLM ``version``'s (a pin; default the newest) DCP module, its plugin loader and
    the modules importing it by name, under their real names (close() removes them)."""
    names = (*VLLM_REAL, *VLLM_PARTS, *VLLM_IMPORTERS)
    root = extract("vllm", [_member(n, VLLM_PACKAGES) for n in names], version)
    m = WheelModules(root)
    stubs = {  # name: (why, attributes)
        "vllm.platforms": ("vllm/platforms/__init__.py detects CUDA/ROCm/... at first use; "
                           "here: no accelerator (is_cuda() False, device_type cpu)",
                           {"current_platform": _Platform(),
                            "vllm_version_matches_substr": lambda _s: False}),
        "vllm.config": ("VllmConfig is a pydantic tree over transformers; dcp.py uses the "
                        "class as an annotation only; no config is current (a server "
                        "sets one around model construction)",
                        {"VllmConfig": type("VllmConfig", (), {}),
                         "get_current_vllm_config_or_none": lambda: None}),
        "vllm.distributed": ("GroupCoordinator and the process groups need NCCL and "
                             "vLLM's initialisation; get_dcp_group() returns the test's "
                             "Coordinator of this rank", {"get_dcp_group": current_group}),
        "vllm.distributed.parallel_state": (
            "as vllm.distributed; in_the_same_node_as is only reached by the direct "
            "symmetric-memory workspaces, which need CUDA (direct_cp_enabled is False "
            "on CPU)", {"in_the_same_node_as": lambda group, source_rank=0: [True]}),
    }
    for name in VLLM_REAL:
        if name == "vllm.envs":
            m.real(name)
            for stub, (why, attrs) in stubs.items():
                m.stub(stub, why, **attrs)
            for part, keep in VLLM_PARTS.items():
                m.part(part, keep)
        else:
            m.real(name)
    for name in VLLM_IMPORTERS:
        m.shell(name, VLLM_DCP)
    return m


# ---- vLLM's model-side code: the MLA layers' weight loading, decode path, context KV ----------
MLA = "vllm.model_executor.layers.attention.mla_attention"
KIMI = "vllm.models.kimi_k3.nvidia.mla"
ATTENTION = "vllm.model_executor.layers.attention.attention"
MLA_FUNCTIONS = ("split_kv_b_proj", "_detect_output_quant_key", "reorg_kvcache",
                 "_get_kv_b_proj_input_dtype")
MLA_METHODS = {  # run from the wheel's source (0.34.0 adds prepare_mqa_query)
    "MLAAttention": ("process_weights_after_loading", "forward_impl", "_prepare_mqa_query",
                     "_v_up_proj", "prepare_mqa_query"),
    "MLACommonBaseImpl": ("_context_parallel_compute_prefill_context",
                          "_concat_k_nope_k_pe"),
}
MLA_SINCE_034 = ("prepare_mqa_query", "_prepare_mqa_query")  # 0.33.0 prepares inline
KIMI_METHODS = {"MultiHeadLatentAttention": ("process_weights_after_loading", "_attention",
                                             "_v_up_proj")}
forward = threading.local()  # the test's forward context of this rank's thread


def _forward_context() -> Any:
    context = getattr(forward, "context", None)
    if context is None:
        raise RuntimeError("get_forward_context(): no forward context in this thread")
    return context


def _attention_context(layer_name: str) -> tuple:
    context = _forward_context()
    return (context.attn_metadata[layer_name], None, None, context.slot_mapping[layer_name])


def _replace_parameter(layer: Any, name: str, tensor: Any) -> None:
    setattr(layer, name, tensor)


def _cp_gather_cache(src_cache: Any, dst: Any, block_table: Any, cu_seq_lens: Any,
                     batch_size: int, seq_starts: Any = None) -> None:
    """vLLM's ops.cp_gather_cache (a CUDA kernel) in torch: request i's cached rows
    ``seq_starts[i] ..`` (block_table[i]'s blocks of the paged cache) into
    ``dst[cu_seq_lens[i]:cu_seq_lens[i + 1]]``."""
    block = src_cache.shape[1]
    for i in range(batch_size):
        lo, hi = int(cu_seq_lens[i]), int(cu_seq_lens[i + 1])
        first = 0 if seq_starts is None else int(seq_starts[i])
        for j in range(hi - lo):
            t = first + j
            dst[lo + j] = src_cache[int(block_table[i, t // block]), t % block]


def _platform() -> Any:
    return _Platform()


def load_vllm_model(version: str | None = None) -> WheelModules:
    """load_vllm(version), then the model-side code that calls the DCP manager, run from
    the wheel's source (transplant): mla_attention.py's MLAAttention (weight loading,
    decode forward, query preparation, W_UV projection) and MLACommonBaseImpl (the
    chunked-context prefill with its DCP KV gather), with the file's helpers; the
    Kimi-K3 NVIDIA layer's weight loading and decode attention; attention.py's two
    quantization-scale helpers. What they call that needs CUDA or the whole engine is a
    named stand-in (tests/engines/test_engines_wheels_mla.py's table)."""
    m = load_vllm(version)
    extract("vllm", [_member(n, VLLM_PACKAGES) for n in (ATTENTION,)], version)
    attention = m.transplant(ATTENTION, ("should_load_quant_weights",
                                         "set_default_quant_scales"))
    own = "the wheel's own (attention.py), run as shipped"
    from types import SimpleNamespace

    common = {
        "current_platform": (_platform(), "no accelerator: is_cuda() False, fp8_dtype() "
                             "e4m3 (only compared, never used: the KV cache is bf16)"),
        "replace_parameter": (_replace_parameter, "assigns the tensor (vLLM keeps the "
                              "Parameter object for weight reloading; same values)"),
        "should_load_quant_weights": (attention.should_load_quant_weights, own),
        "set_default_quant_scales": (attention.set_default_quant_scales, own),
        "is_quantized_kv_cache": (lambda kv_cache_dtype: kv_cache_dtype != "auto",
                                  "KV cache dtype 'auto' (bf16) is not quantized, as "
                                  "vLLM's get_kv_quant_mode says"),
    }
    text = (m.root / "vllm/model_executor/layers/attention/mla_attention.py").read_text()
    methods = {k: tuple(x for x in v if x not in MLA_SINCE_034 or f"def {x}(" in text)
               for k, v in MLA_METHODS.items()}
    mla = m.transplant(MLA, MLA_FUNCTIONS, methods, {
        **common,
        "get_dcp_group": (current_group, "the test's Coordinator of this rank"),
        "get_and_maybe_dequant_weights": (
            lambda layer, out_dtype: layer.weight.to(out_dtype),
            "an unquantized kv_b_proj: its weight in out_dtype (vLLM's for it)"),
        "get_attention_context": (_attention_context, "the layer's attention metadata of "
                                  "the test's forward context (vLLM's custom-op context)"),
        "ops": (SimpleNamespace(cp_gather_cache=_cp_gather_cache),
                "vllm._custom_ops: cp_gather_cache (a CUDA kernel) in torch"),
    })
    m.transplant(KIMI, (), KIMI_METHODS, {
        **common,
        "split_kv_b_proj": (mla.split_kv_b_proj, "the wheel's own (mla_attention.py)"),
        "is_weights_pre_processed": (lambda: False, "no weight-cache daemon: the weights "
                                     "are absorbed here"),
        "refill_derived": (_replace_parameter, "assigns the tensor (as replace_parameter)"),
        "get_forward_context": (_forward_context, "the test's forward context of this "
                                "rank's thread"),
        "eager_break_during_capture": (lambda fn: fn, "a CUDA-graph break around the "
                                       "decorated method: nothing to break eagerly"),
        "resolve_quant_method": (lambda *a, **k: None, "not reached: no quant_config"),
    })
    return m


# ---- SGLang --------------------------------------------------------------------------
SGLANG_COMM = "sglang.srt.layers.dcp.comm"
SGLANG_REAL = (
    "sglang.srt.environ", "sglang.srt.plugins.hook_registry", "sglang.srt.plugins",
    "sglang.kernels.ops.attention.dcp_kernels", SGLANG_COMM, "sglang.srt.layers.dcp.layout",
    "sglang.srt.layers.dcp.metadata", "sglang.srt.layers.dcp")
SGLANG_PACKAGES = {"sglang.srt.plugins", "sglang.srt.layers.dcp"}
SGLANG_IMPORTERS = (  # modules of the wheel importing the replaced names by name, beside
    # sglang.srt.layers.dcp (real, above); forward_mla_rocm imports the same names
    "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla",)


def _no_parallel() -> Any:
    raise RuntimeError("sglang.srt.runtime_context.get_parallel() is a stub here")


class _ModelRunner:
    def forward(self, *args: Any, **kwargs: Any) -> str:
        return "forward"


class _RadixAttention:
    def __init__(self, layer_id: int):
        self.layer_id = layer_id

    def forward(self, *args: Any, **kwargs: Any) -> int:
        return self.layer_id


def load_sglang() -> WheelModules:
    """SGLang's (the pin) DCP package, its plugin loader and hook registry, and the
    DeepSeek MLA forward's import of the DCP names, under their real names."""
    names = (*SGLANG_REAL, *SGLANG_IMPORTERS)
    root = extract("sglang", [_member(n, SGLANG_PACKAGES) for n in names])
    m = WheelModules(root)
    m.real("sglang.srt.environ")
    m.real("sglang.srt.plugins.hook_registry")
    m.real("sglang.srt.plugins")
    from contextlib import nullcontext

    m.stub("sglang.srt.distributed.parallel_state",
           "GroupCoordinator needs NCCL and SGLang's initialisation; get_dcp_group() "
           "returns the test's Coordinator of this rank",
           GroupCoordinator=Coordinator, get_dcp_group=current_group)
    m.stub("sglang.srt.distributed.device_communicators.pynccl_allocator",
           "NCCL's symmetric-memory allocator: a null context (CPU tensors)",
           use_symmetric_memory=lambda *a, **k: nullcontext())
    m.stub("sglang.srt.runtime_context", "the server's parallel state: get_parallel() "
           "raises (only the KV-length and KV-gather helpers read it; no test calls them)",
           get_parallel=_no_parallel)
    m.stub("sglang.srt.utils", "the package imports the server: is_hip() False (CPU)",
           is_hip=lambda: False)
    m.stub("sglang.srt.utils.common", "is_fi_a2a_supported() False (no FlashInfer on CPU)",
           is_fi_a2a_supported=lambda *a, **k: False)
    m.stub("sglang.srt.model_executor.model_runner", "the model runner imports the whole "
           "server: a ModelRunner with only forward(), the method dcpc's call-id hook "
           "runs BEFORE (its arguments are not read)", ModelRunner=_ModelRunner)
    m.stub("sglang.srt.layers.radix_attention", "imports the attention backends (CUDA): a "
           "RadixAttention with only layer_id and forward(), all dcpc's layer hook reads",
           RadixAttention=_RadixAttention)
    for name in SGLANG_REAL[3:]:
        if name != "sglang.srt.layers.dcp":
            m.real(name)
    m.real("sglang.srt.layers.dcp")
    for name in SGLANG_IMPORTERS:
        m.shell(name, "sglang.srt.layers.dcp")
    return m
