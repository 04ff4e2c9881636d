"""What each shipped schedule's steps return, in program order: the buffers a benchmark
binds by name (benchmarks/support/modules.py) and the references check
(benchmarks/support/reference.py). A leaf: it imports nothing of the suite."""

from __future__ import annotations

# schedule -> [(step, buffers it returns, in order)], program order, external steps left out
STEPS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "kimi_k3_dcp": [("query_gather", ("q_full",)), ("out_exchange", ("o_recv", "lse_recv")),
                    ("merge", ("out",))],
    "kimi_k3_dcp_fused": [("query_gather", ("q_full",)), ("combine", ("out", "out_lse"))],
    "kimi_k3_dcp_staging": [("query_gather", ("q_stage",)), ("query_copy", ("q_full",)),
                            ("out_exchange", ("o_recv", "lse_recv")), ("merge", ("out",))],
    "kimi_k3_dcp_ag_rs": [("query_gather", ("q_full",)), ("lse_gather", ("lse_all",)),
                          ("correct", ("o_corr",)), ("out_scatter", ("out",))],
    "kv_gather": [("kv_gather", ("kv_full",)), ("release", ())],
}
DECODE = ("kimi_k3_dcp", "kimi_k3_dcp_fused", "kimi_k3_dcp_staging", "kimi_k3_dcp_ag_rs")
