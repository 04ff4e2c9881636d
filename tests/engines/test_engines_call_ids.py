"""Call ids through the adapters (dcpc.engines.call_ids): a rank that skips one DCP call
of a forward (one layer's), or every call of a forward, raises on the next call on every
rank, naming it, instead of pairing its calls with its peers' previous ones and returning
mixed data (issue 22 item 2). The ``local`` backend (ranks as threads, Triton
interpreter), W = 2 and 3, against float64; the install hooks on stand-in modules."""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types

import pytest
import torch

from dcpc.engines import call_ids as C
from dcpc.runtime.errors import DcpcArgumentError, DcpcError
from dcpc.runtime.local import LocalGroup

LAYERS = 3


def _layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _inputs(seed: int, world: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(3, 2 * world, 16, generator=g).bfloat16() for _ in range(world)]
    lses = [torch.randn(3, 2 * world, generator=g) * 2 for _ in range(world)]
    return outs, lses


def _call(fn: str, rank, world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of adapter function ``fn`` on this rank: (result, float64 reference)."""
    from dcpc.engines import reference as ref
    from dcpc.engines import sglang as S
    from dcpc.engines import vllm as V

    r = rank.rank
    if fn == "sglang q gather":
        g = torch.Generator().manual_seed(seed)
        nope = [torch.randn(3, 2, 16, generator=g).bfloat16() for _ in range(world)]
        pe = [torch.randn(3, 2, 8, generator=g).bfloat16() for _ in range(world)]
        got = S.all_gather_q_for_mla_decode(nope[r], pe[r], rank)
        return torch.cat(got, dim=-1), torch.cat([ref.gather_heads(nope),
                                                  ref.gather_heads(pe)], dim=-1)
    outs, lses = _inputs(seed, world)
    got = getattr(V, fn)(outs[r], lses[r], rank)
    return got, ref.vllm_combine(outs, lses)[r][0]


def _forwards(rank, world: int, plan: list[list[int]], fn: str = "dcp_a2a_lse_reduce"
              ) -> list[tuple]:
    """Run ``plan`` (per forward, the layers this rank calls) through adapter function
    ``fn``; per call (forward, layer, wrong elements of the result against float64, or
    the error's type and text). Stops at the first error."""
    done: list[tuple] = []
    for forward, layers in enumerate(plan, 1):
        C.begin_forward()
        for layer in layers:
            C.enter_layer(_layer(layer))
            try:
                got, want = _call(fn, rank, world, 100 * forward + layer)
            except DcpcError as err:
                done.append((forward, layer, type(err).__name__, str(err)))
                return done
            wrong = ~((got.double() - want).abs() <= 2e-2 + 2e-2 * want.abs())
            done.append((forward, layer, int(wrong.sum()), got.numel()))
    return done


RAISED = ("DcpcContractError", "DcpcPeerFailedError")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", "8")
    yield
    from dcpc.engines import combine

    combine.reset()  # every rank's thread is done: close this test's modules


@pytest.mark.parametrize("world, fn", [
    (2, "dcp_a2a_lse_reduce"), (3, "dcp_a2a_lse_reduce"),  # the fused combine + release
    (2, "cp_lse_ag_out_rs"),  # ag_rs: no release step, the gather sees the ids
    (3, "sglang q gather"),  # GatherRunner (SGLang's all_gather_q_for_mla_decode)
])
def test_a_rank_that_skips_one_layer_raises_on_the_next_call_on_every_rank(world, fn, cache):
    """Rank 1 skips layer 1 of three (an empty-KV-shard shortcut, say). Without call ids
    its layer-2 call paired with its peers' layer-1 call and both returned mixed data;
    now each rank's second call raises, naming its own layer."""
    plans = {r: [[0, 2] if r == 1 else [0, 1, 2]] for r in range(world)}
    found = LocalGroup(world, "cpu", timeout_s=180).run(
        lambda rank: _forwards(rank, world, plans[rank.rank], fn))
    for r, calls in enumerate(found):
        assert calls[0][:3] == (1, 0, 0), (r, found)  # layer 0: right on every rank
        # each rank raises at its second call: a contract error naming its own layer, or
        # (a peer raised first: its failure flag is seen before the ids) the peer's failure
        assert len(calls) == 2 and calls[1][2] in RAISED, (r, found)
        if calls[1][2] == "DcpcContractError":
            layer = 2 if r == 1 else 1
            text = calls[1][3]
            assert "call_id (mod 256)" in text and f"layer '{_layer(layer)}' of forward 1" \
                in text, (r, text)
    assert any(calls[1][2] == "DcpcContractError" for calls in found), found


def test_a_rank_that_skips_a_whole_forward_raises_at_the_next_forward(cache):
    """Rank 1 enters forward 2 but makes none of its calls: its forward-3 call meets its
    peer's forward-2 call, the same layer: the forward number tells them apart."""
    plans = {0: [[0], [0], [0]], 1: [[0], [], [0]]}
    found = LocalGroup(2, "cpu", timeout_s=180).run(
        lambda rank: _forwards(rank, 2, plans[rank.rank]))
    assert found[0][0][:3] == found[1][0][:3] == (1, 0, 0), found
    for r, forward in ((0, 2), (1, 3)):
        assert found[r][1][:2] == (forward, 0) and found[r][1][2] in RAISED, (r, found)
        if found[r][1][2] == "DcpcContractError":  # else its peer raised first
            assert f"layer '{_layer(0)}' of forward {forward}" in found[r][1][3], found[r]
    assert any(f[1][2] == "DcpcContractError" for f in found), found


def test_ids_come_from_the_layer_and_the_forward_only():
    def fresh() -> list:
        got = [C.current_call_id()]  # nothing known: no id (pairing by order, as before)
        C.enter_layer("model.layers.7.mlp.attn")
        got.append(C.current_call_id())
        got.append(C.begin_forward())
        got.append(C.current_call_id())  # a forward forgets the layer
        C.enter_layer(_layer(5))
        got.append(C.current_call_id())
        C.begin_forward(40)
        C.enter_layer(12)  # SGLang's layer_id
        got += [C.current_call_id(), C.call_site()]
        return got

    assert contextvars.copy_context().run(fresh) == [
        None, 7, 1, C.FORWARD_STRIDE - 1, 5 + C.FORWARD_STRIDE, 12 + 40 * C.FORWARD_STRIDE,
        "layer '12' of forward 40"]
    # two numbers (or none): the crc32 of the name, the same in every process
    assert C.layer_number("a.1.b.2") == 3643077296 and C.layer_number("attn") == 276791131
    with pytest.raises(DcpcArgumentError, match="step must be an int"):
        C.begin_forward("3")  # type: ignore[arg-type]
    with pytest.raises(DcpcArgumentError, match=r"layer must be an int .* got None"):
        C.enter_layer(None)  # type: ignore[arg-type]


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def test_vllm_install_hooks_the_forward_and_the_layer(monkeypatch):
    """install() wraps vLLM's set_forward_context and get_attention_context (and every
    `from ... import` binding of them); the ids follow what the engine enters."""
    from dcpc.engines import vllm_install

    seen: list = []

    @contextlib.contextmanager
    def set_forward_context(attn_metadata, vllm_config, **kw):
        seen.append(("enter", attn_metadata))
        yield "ctx"
        seen.append("exit")

    def get_attention_context(layer_name):
        seen.append(C.current_call_id())
        return layer_name

    fc = _module("vllm.forward_context", set_forward_context=set_forward_context)
    at = _module("vllm.model_executor.layers.attention.attention",
                 get_attention_context=get_attention_context)
    user = _module("vllm.v1.worker.gpu_model_runner", set_forward_context=set_forward_context)
    for m in (fc, at, user):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    assert sorted(vllm_install.hook_calls()) == [
        "vllm.forward_context.set_forward_context",
        "vllm.model_executor.layers.attention.attention.get_attention_context",
        "vllm.v1.worker.gpu_model_runner.set_forward_context"]
    assert vllm_install.hook_calls() == []  # idempotent

    def engine() -> None:
        for step in range(2):
            with user.set_forward_context({"meta": step}, None) as ctx:
                assert ctx == "ctx"
                for i in (0, 1):
                    at.get_attention_context(_layer(i))

    contextvars.copy_context().run(engine)
    s = C.FORWARD_STRIDE
    assert seen == [("enter", {"meta": 0}), 0 + s, 1 + s, "exit",
                    ("enter", {"meta": 1}), 0 + 2 * s, 1 + 2 * s, "exit"]


def test_sglang_install_hooks_the_forward_and_the_layer(monkeypatch):
    """Without SGLang's HookRegistry, install() wraps ModelRunner.forward and
    RadixAttention.forward by hand (once)."""
    from dcpc.engines import sglang as S

    class ModelRunner:
        def forward(self, forward_batch):
            return [layer.forward(forward_batch) for layer in self.layers]

    class RadixAttention:
        def __init__(self, layer_id):
            self.layer_id = layer_id

        def forward(self, batch):
            return (batch, C.current_call_id())

    mr = _module("sglang.srt.model_executor.model_runner", ModelRunner=ModelRunner)
    ra = _module("sglang.srt.layers.radix_attention", RadixAttention=RadixAttention)
    for m in (mr, ra):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(ModelRunner, "forward", ModelRunner.forward)  # undone after
    monkeypatch.setattr(RadixAttention, "forward", RadixAttention.forward)
    assert S._hook_methods() == list(S.CALL_HOOKS)
    assert S._hook_methods() == []  # idempotent
    runner = ModelRunner()
    runner.layers = [RadixAttention(0), RadixAttention(1)]
    got = contextvars.copy_context().run(lambda: [runner.forward("b"), runner.forward("c")])
    s = C.FORWARD_STRIDE
    assert got == [[("b", s), ("b", 1 + s)], [("c", 2 * s), ("c", 1 + 2 * s)]]


def test_the_layer_hook_is_left_out_of_a_compiled_graph():
    """vLLM off CUDA calls its attention ops directly inside torch.compile(fullgraph=True):
    a context variable set there is unsupported (Dynamo raises); the hook then sets
    nothing and calls vLLM's function."""
    seen = []
    hooked = C.layer_hook(lambda name: seen.append(name) or name)

    def layer(x: torch.Tensor) -> torch.Tensor:
        hooked(_layer(3))
        return x * 2

    def run() -> tuple:
        got = torch.compile(layer, fullgraph=True, backend="eager")(torch.ones(2))
        before = C.current_call_id()
        hooked(_layer(4))  # eager: the layer is entered
        return got.tolist(), before, C.current_call_id()

    assert contextvars.copy_context().run(run) == ([2.0, 2.0], None, 4)
    assert seen == [_layer(3), _layer(4)]
