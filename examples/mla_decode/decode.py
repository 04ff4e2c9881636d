"""An engine-style MLA decode loop under DCP, driving a dcpc-generated module.

Each of the W ranks holds its interleaved shard of every request's KV cache and the
query of its H/W heads. Per step and microbatch:

    q_full = dcp.query_gather(q_local)        # all heads' query, gathered direct to final
    o, lse = attention(q_full, kv_shard)      # the engine's kernel, ALL heads, local shard
    dcp.out_exchange(o, lse)                  # partials for rank r's heads go to rank r
    out    = dcp.merge(seq_lens, query_start_loc)   # LSE merge, empty shards masked

then the "model" samples a greedy token per request, appends it to the cache and goes
on. check.py compares every step with attention over the full, unsplit cache.

    CPU (host backend, Triton interpreter, gloo):
        python examples/mla_decode/decode.py --world 2 --steps 4
    GPU (symm_mem backend, NCCL, one GPU per rank), with a module compiled elsewhere:
        dcpc compile schedules/kimi_k3_dcp.yaml -o build/dcp --world 2
        torchrun --nproc-per-node 2 examples/mla_decode/decode.py --device cuda \\
            --steps 100 --graph --module build/dcp/kimi_k3_dcp.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import D_QK, D_V, GARBAGE_LSE, local_seq_len, mla_decode_attention  # noqa: E402
from check import CheckStats, compare_outputs, compare_tokens, merge_stats_across_ranks  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # dcpc.runtime for the generated module when dcpc is not installed
INTERLEAVE = 1  # must equal the schedule's mask_empty interleave (kimi_k3_dcp: default 1)
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # CUDA-graph batch sizes, as vLLM
POS_PERIOD = 251  # positional tables repeat with this period (keeps them small)


class TinyModel:
    """Deterministic stand-ins for embeddings and the LM head (same seed on every rank)."""

    def __init__(self, heads: int, vocab: int, device: torch.device, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.kv_embed = torch.randn(vocab, D_QK, generator=g).to(device)
        self.kv_pos = (0.5 * torch.randn(POS_PERIOD, D_QK, generator=g)).to(device)
        self.q_embed = torch.randn(vocab, heads, D_QK, generator=g).to(device)
        self.q_pos = (0.5 * torch.randn(POS_PERIOD, heads, D_QK, generator=g)).to(device)
        self.lm_head = (torch.randn(heads * D_V, vocab, generator=g) / math.sqrt(heads * D_V))
        self.lm_head = self.lm_head.to(device)

    def kv_rows(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (self.kv_embed[tokens] + self.kv_pos[positions % POS_PERIOD]).bfloat16()

    def queries(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (self.q_embed[tokens] + self.q_pos[positions % POS_PERIOD]).bfloat16()

    def logits(self, out_all_heads: torch.Tensor) -> torch.Tensor:
        """[T, H, Dv] -> [T, vocab]: stands in for o_proj + the rest of the model."""
        return out_all_heads.float().flatten(1) @ self.lm_head


class Microbatch:
    """One microbatch's requests on this rank: its KV shard and the step's inputs.

    The tensors are allocated once and updated in place, as an engine's persistent
    input buffers are, so a CUDA graph captured over them replays with new values.
    """

    def __init__(self, ctx_lens, steps, model, rank, world, heads, device, seed):
        self.rank, self.world, self.model = rank, world, model
        self.lengths = torch.tensor(ctx_lens, dtype=torch.long)  # host: the scheduler knows
        self.num_requests = B = len(ctx_lens)
        self.padded_rows = next(s for s in CAPTURE_SIZES if s >= B)  # one token per request
        capacity = int(self.lengths.max()) + steps
        local_capacity = int(local_seq_len(torch.tensor(capacity), 0, world, INTERLEAVE))
        self.heads = slice(rank * heads // world, (rank + 1) * heads // world)

        self.kv_shard = torch.zeros(B, max(local_capacity, 1), D_QK, dtype=torch.bfloat16,
                                    device=device)
        self.q_local = torch.zeros(self.padded_rows, heads // world, D_QK,
                                   dtype=torch.bfloat16, device=device)
        self.seq_lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.out: torch.Tensor | None = None  # the module's view; read before the next call

        # Checker-only state: the full cache and every head's query (no engine has these).
        self.kv_full = torch.zeros(B, capacity, D_QK, dtype=torch.bfloat16, device=device)
        self.q_all_heads = torch.zeros(self.padded_rows, heads, D_QK, dtype=torch.bfloat16,
                                       device=device)

        # "Prefill": random prompt tokens whose KV rows fill the caches.
        g = torch.Generator().manual_seed(seed)
        vocab = model.kv_embed.shape[0]
        for b, n in enumerate(ctx_lens):
            self._append(torch.full((n,), b), torch.arange(n),
                         torch.randint(vocab, (n,), generator=g))
        self.tokens = torch.randint(vocab, (B,), generator=g)  # each request's next input
        self.padding_rng = g

    def _append(self, requests, positions, tokens):
        rows = self.model.kv_rows(tokens.to(self.kv_full.device), positions.to(self.kv_full.device))
        self.kv_full[requests, positions] = rows
        mine = (positions // INTERLEAVE) % self.world == self.rank
        local_index = local_seq_len(positions, self.rank, self.world, INTERLEAVE)  # rows before
        self.kv_shard[requests[mine], local_index[mine]] = rows[mine.to(rows.device)]

    def begin_step(self):
        """Write this step's input tokens into the KV cache and the persistent inputs."""
        B = self.num_requests
        positions = self.lengths.clone()
        self._append(torch.arange(B), positions, self.tokens)
        self.lengths += 1
        q = self.model.queries(self.tokens.to(self.q_local.device),
                               positions.to(self.q_local.device))
        self.q_all_heads[:B] = q
        # Padding rows hold whatever the last batch left; here: fresh garbage.
        garbage = torch.randn(self.padded_rows - B, *q.shape[1:], generator=self.padding_rng)
        self.q_all_heads[B:] = garbage.to(q.device, q.dtype)
        self.q_local.copy_(self.q_all_heads[:, self.heads])
        self.seq_lens.copy_(self.lengths.to(torch.int32))  # non_blocking in a real engine


def attention_layer(dcp, mb: Microbatch, slot: int, empty_lse: float):
    """One microbatch's attention under DCP, as a generator that yields between phases,
    so a DBO scheduler can interleave two microbatches (each on its own slot/stream).

    The order query_gather -> attention -> out_exchange -> merge is the call-order
    contract the checker proved: the exchange after attention is what keeps the next
    query_gather of this slot from overwriting q_full while a peer still reads it.
    """
    q_full = dcp.query_gather(mb.q_local, slot=slot)  # view of the slot's symmetric buffer
    yield
    o_part, lse_part = mla_decode_attention(
        q_full, mb.kv_shard, mb.seq_lens, mb.query_start_loc,
        rank=mb.rank, world=mb.world, interleave=INTERLEAVE, empty_lse=empty_lse)
    yield
    dcp.out_exchange(o_part, lse_part, slot=slot)
    yield
    mb.out = dcp.merge(mb.seq_lens, mb.query_start_loc, slot=slot)


def run_overlapped(dcp, microbatches, streams, empty_lse: float) -> None:
    """Ping-pong the microbatches phase by phase; microbatch i uses slot i and stream i."""
    on_gpu = streams[0] is not None
    if on_gpu:  # fork: side streams start after what the current stream has queued
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
    layers = [(attention_layer(dcp, mb, slot, empty_lse), streams[slot])
              for slot, mb in enumerate(microbatches)]
    while layers:
        for layer in list(layers):
            gen, stream = layer
            with torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
                if next(gen, StopIteration) is StopIteration:
                    layers.remove(layer)
    if on_gpu:  # join
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)


def gather_heads(out_local: torch.Tensor, group) -> torch.Tensor:
    """[T, H/W, Dv] on every rank -> [T, H, Dv] everywhere (for sampling and checking)."""
    mine = out_local.float().contiguous()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.cat(parts, dim=1)


def sample_and_check(mb: Microbatch, group, stats: CheckStats) -> None:
    """Greedy token per request from the DCP output, checked against full attention."""
    B = mb.num_requests
    out_all = gather_heads(mb.out, group)  # consume the view before this slot's next call
    ref, _ = mla_decode_attention(mb.q_all_heads[:B].float(), mb.kv_full, mb.seq_lens,
                                  mb.query_start_loc)  # one rank, whole cache
    compare_outputs(stats, out_all, ref)
    shards = torch.stack([local_seq_len(mb.seq_lens, p, mb.world, INTERLEAVE)
                          for p in range(mb.world)])
    stats.rows_with_empty_shard += int((shards == 0).any(dim=0).sum())  # one row per request
    tokens = compare_tokens(stats, mb.model.logits(out_all[:B]), mb.model.logits(ref))
    mb.tokens = tokens.cpu()


def load_module_class(args, world: int):
    """Import the generated module (compile the schedule first unless --module is given)."""
    path = Path(args.module) if args.module else compile_schedule(Path(args.schedule), world)
    from dcpc.runtime.loading import import_file, schedule_class  # what an engine uses

    return schedule_class(import_file(path, f"dcpc_example_{path.stem}"))


def compile_schedule(schedule: Path, world: int) -> Path:
    from dcpc.pipeline import Options, run  # the compiler; engines import only its output

    compiled = run(schedule, Options(worlds=[world]))
    out = Path(tempfile.mkdtemp(prefix="dcpc_example_")) / f"{compiled.schedule.schedule}.py"
    out.write_text(compiled.module_text)
    return out


def worker(rank: int, world: int, args) -> bool:
    device = torch.device("cpu")
    if args.device == "cpu":
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    torch.manual_seed(args.seed)

    model = TinyModel(args.heads, args.vocab, device, args.seed)
    microbatches = [Microbatch(lens, args.steps, model, rank, world, args.heads, device,
                               args.seed + 1 + i) for i, lens in enumerate(args.batches)]
    dcp_class = load_module_class(args, world)
    # programs: fewer Triton programs per signalling kernel; the CPU interpreter runs
    # them one after another, so the host backend is much faster with a few.
    tuning = {} if args.programs is None else {"programs": args.programs}
    sizes = {"H": args.heads,
             "T": max(mb.padded_rows for mb in microbatches),  # allocate for the largest
             "B": max(mb.num_requests for mb in microbatches)}
    dcp = dcp_class(group, sizes=sizes, device=device, backend=args.backend, **tuning)
    on_gpu = device.type == "cuda"
    streams = [torch.cuda.Stream() if on_gpu else None for _ in microbatches]
    empty_lse = GARBAGE_LSE if args.empty_lse == "garbage" else -math.inf
    stats, step_ms, graph = CheckStats(), [], None

    for step in range(args.steps):
        for mb in microbatches:
            mb.begin_step()
        if args.graph and step == 1:  # step 0 ran eagerly: Triton kernels are compiled
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_overlapped(dcp, microbatches, streams, empty_lse)
        start = time.perf_counter()
        if graph is not None:
            graph.replay()  # same buffers, new values; epochs advance on the device
        else:
            run_overlapped(dcp, microbatches, streams, empty_lse)
        if on_gpu:
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - start) * 1e3)
        for mb in microbatches:
            sample_and_check(mb, group, stats)
        stats.steps += 1

    stats = merge_stats_across_ranks(stats, group)
    if rank == 0:
        write_result(args, world, microbatches, stats, step_ms, device)
    dcp.close()
    dist.destroy_process_group()
    return stats.passed


def write_result(args, world, microbatches, stats, step_ms, device) -> None:
    timed = sorted(step_ms[2:] or step_ms)  # leave out compile and capture steps
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world": world, "heads": args.heads, "backend": args.backend, "graph": args.graph,
        "microbatches": [list(map(int, b)) for b in args.batches],
        "padded_rows": [mb.padded_rows for mb in microbatches],
        "empty_lse": args.empty_lse,
        **stats.as_dict(),
        "time_per_step_ms": timed[len(timed) // 2],
        "time_per_step_note": "median wall time of one step's attention layer for all "
                              "microbatches (query_gather, the example's torch attention, "
                              "out_exchange, merge; graph replay or eager calls) plus a "
                              "device sync; sampling and checking excluded; the first two "
                              "steps (compile, capture) are left out",
    }
    path = result_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def result_path(args) -> Path:
    if args.json:
        return Path(args.json)
    folder = Path(os.environ.get("OUT") or REPO / "benchmarks/results")
    return folder / f"mla_decode_{'gpu' if args.device == 'cuda' else 'cpu'}.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world", type=int, default=2, help="CPU only; on GPU torchrun sets it")
    p.add_argument("--heads", type=int, default=4, help="query heads over the group (H)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batches", nargs="+", default=["0,1,5,40,2", "2,0,13"],
                   help="context lengths, one comma list per microbatch (at most 2: slots)")
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--programs", type=int, help="programs per signalling kernel (module default)")
    p.add_argument("--backend", default="auto", choices=["auto", "symm_mem", "host", "torch"])
    p.add_argument("--graph", action="store_true", help="CUDA: capture the step, replay it")
    p.add_argument("--empty-lse", choices=["garbage", "-inf"], default="garbage",
                   help="what the attention leaves in the LSE of an empty shard")
    p.add_argument("--schedule", default=str(REPO / "schedules/kimi_k3_dcp.yaml"))
    p.add_argument("--module", help="a generated module file (skips compiling --schedule)")
    p.add_argument("--json", help="result file (default $OUT or benchmarks/results)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.batches = [[int(n) for n in b.split(",")] for b in args.batches]
    if args.graph and args.device != "cuda":
        p.error("--graph needs --device cuda")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":  # launched by torchrun: one process per GPU
        passed = worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0 if passed else 1
    os.environ.setdefault("TRITON_INTERPRET", "1")  # host backend: kernels on the CPU
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not args.module:  # compile once here rather than in every rank
        args.module = str(compile_schedule(Path(args.schedule), args.world))
    torch.multiprocessing.spawn(worker, args=(args.world, args), nprocs=args.world)
    return 0 if json.loads(result_path(args).read_text())["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
