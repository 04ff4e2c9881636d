"""Drop-in adapters of dcpc's generated modules for vLLM's and SGLang's DCP interfaces.

``dcpc.engines.vllm`` and ``dcpc.engines.sglang`` mirror the engines' functions (same
names, arguments and results); ``dcpc.engines.common`` builds, compiles and caches the
schedules they run; ``dcpc.engines.reference`` is the float64 statement of each
function's semantics that the tests compare with. See docs/engines.md, "Engine
adapters: vLLM and SGLang".
"""

from dcpc.engines.call_ids import begin_forward, enter_layer

__all__ = ["begin_forward", "enter_layer"]
