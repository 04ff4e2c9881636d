"""The Helix combine of closed vLLM PR #34024 (vllm/v1/attention/ops/helix.py) on a dcpc
module. PR #34024 was closed unmerged: no vLLM release has the module (0.33.0 and 0.34.0
do not), so ``install()`` patches nothing on a released vLLM; it serves a vLLM built
from that branch, or an engine calling the function itself.

``helix_alltoall_lse_reduce(local_output, local_lse, kvp_group, return_lse,
is_lse_base_on_e)`` has vLLM's signature and results: every rank of the KV-parallel
(KVP) group holds partial attention outputs [B, H, D] of ALL heads over its own KV
shard, with their LSEs [B, H]; rank r gets the LSE-weighted merge of heads r*H/N ..
(r+1)*H/N - 1 over every shard, [B, H/N, D] in the output's dtype, and with
``return_lse`` their merged LSE [B, H/N] in the LSE's dtype. vLLM does it with two
``all_to_all_single`` calls and a Triton merge; here it is the fused all-to-all +
merge schedule that dcp_a2a_lse_reduce runs (dcpc path ``fused``: one launch on
symmetric memory, proved by ``dcpc check``), the same schedule as the KVP axis of
schedules/gallery/helix.yaml. The first call of a family warms every CUDA-graph capture
size up, as the other adapters' (dcpc.engines.capture).

Non-finite LSEs: vLLM's Helix merge treats a NaN or +inf LSE as -inf (that shard adds
nothing); so does dcpc's merge, and a row whose shards are all -inf merges to 0 with
LSE -inf, as vLLM's. ``install()`` puts it over vLLM's (when vLLM has Helix) and keeps
vLLM's own as the fallback of calls dcpc does not take (more tokens than the
workspace, an unsupported dtype, ``DCPC_VLLM_HELIX=0``).
"""

from __future__ import annotations

from typing import Any

import torch

from dcpc.engines.common import log, log_once, rebind
from dcpc.engines.vllm_free import vllm_combine

HELIX_SWITCH = "DCPC_VLLM_HELIX"
_originals: dict[str, Any] = {}


def helix_alltoall_lse_reduce(local_output: torch.Tensor, local_lse: torch.Tensor,
                              kvp_group: Any, return_lse: bool = False,
                              is_lse_base_on_e: bool = True) -> Any:
    """vLLM's helix_alltoall_lse_reduce (see the module's docstring)."""
    original = _originals.get("helix_alltoall_lse_reduce")
    engine = None
    if original is not None:
        def engine() -> Any:
            return original(local_output, local_lse, kvp_group, return_lse, is_lse_base_on_e)
    got = vllm_combine("fused", local_output, local_lse, kvp_group, return_lse,
                       is_lse_base_on_e, None, None, switch_name=HELIX_SWITCH,
                       label="helix_alltoall_lse_reduce", engine=engine,
                       again=lambda o, lse, _s, _q: helix_alltoall_lse_reduce(
                           o, lse, kvp_group, return_lse, is_lse_base_on_e))
    if not return_lse:
        return got
    out, lse = got
    return out, lse.to(local_lse.dtype)  # vLLM's Helix returns the LSE in its input dtype


def install() -> list[str]:
    """Put ``helix_alltoall_lse_reduce`` over vLLM's in every module that holds it;
    vLLM's own stays the fallback. Idempotent; returns the bindings patched ([] when
    this vLLM has no vllm.v1.attention.ops.helix, as no release has: logged once)."""
    try:
        import vllm.v1.attention.ops.helix as ops  # type: ignore[import-not-found]
    except ImportError as err:
        log_once("vllm-helix", f"dcpc.engines.helix.install(): nothing to patch ({err}; "
                 "Helix is closed vLLM PR #34024, in no release)")
        return []
    name = "helix_alltoall_lse_reduce"
    old = vars(ops).get(name)
    if old is None:
        log_once("vllm-helix", f"dcpc.engines.helix.install(): {ops.__name__} has no {name}")
        return []
    if old is helix_alltoall_lse_reduce:
        return []
    if not getattr(old, "__module__", "").startswith("dcpc."):
        _originals.setdefault(name, old)
    patched = rebind(name, old, helix_alltoall_lse_reduce)
    log.info("dcpc.engines.helix.install(): patched %s", ", ".join(patched))
    return patched
