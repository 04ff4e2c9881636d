"""Drop-in adapters of dcpc's generated modules for vLLM's and SGLang's DCP interfaces.

``dcpc.engines.vllm`` and ``dcpc.engines.sglang`` mirror the engines' functions (same
names, arguments and results); ``dcpc.engines.common`` builds, compiles and caches the
schedules they run; ``dcpc.engines.reference`` is the float64 statement of each
function's semantics that the tests compare with. See docs/engines.md, "Engine
adapters: vLLM and SGLang".

The modules, each importing only from those before it in this list:

- common (specs, the module cache, the group, switches), call_ids, fallback (torch
  collectives and math), reference;
- runners (the table of the runners built, read through its functions), capture (the
  CUDA-graph warm-up);
- agree (one path on every rank; a refused call's empty call or failed modules);
- combine (the runners, one combine call, reset);
- the engines: sglang; vllm_free (vLLM's free functions, switches and config),
  vllm_manager, vllm_kv, vllm_pieces (what install() replaces), contract (what an
  engine's code uses, read from source; its command line reads the pieces),
  vllm_install, and vllm, the plugin face (install()), which no module imports; helix;
  warm.
"""

from dcpc.engines.call_ids import begin_forward, enter_layer

__all__ = ["begin_forward", "enter_layer"]
