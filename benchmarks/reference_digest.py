"""What the GPU run's reference side makes of a case, as one sha256 per case: the seeded
sizes, inputs and external steps of every call (dcpc.harness.synth with the op modules'
input rules: input_rules, inputs, io, moves) and, with --simulate, the float64
reference's outputs (worker.CallSims: what every rank's outputs are compared with).
Two trees with equal digests for every case feed the GPU run the same inputs and
compare its outputs with the same values: the evidence a reviewer needs before adding
an entry of the key's "reference" part to benchmarks/results/gpu_equivalent.json
(benchmarks/gpu_pending.py).

    python3 benchmarks/reference_digest.py TREE [--simulate] < cases.json
        # [[file, world, sizes], ...] -> {"file@world": sha | "error: ..."}

(TREE: a commit's `git archive` unpacked; the cases from gpu_conformance.cases; run it
for both commits and compare: benchmarks/README.md.)

Runs against TREE's own dcpc (TREE first on sys.path), on the CPU; only the standard
library is imported at the top.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

SEEDS = (0, 1, 2)  # gpu_conformance --repeat 3: seeds 0, 1, 2
CALLS = 8  # gpu_conformance --calls 8


def feed(h: Any, value: Any) -> None:
    """Hash ``value`` (tensors by dtype, shape and bytes; containers in order, dicts by
    key) into ``h``."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        t = t.reshape(-1)  # a 0-d tensor (a ragged count's view) has no byte view
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool and
                 t.numel() else t.numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=str):
            feed(h, str(k))
            feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, list | tuple):
        h.update(b"[")
        for v in value:
            feed(h, v)
        h.update(b"]")
    elif value is None or isinstance(value, bool | int | float | str):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif hasattr(value, "__dict__"):
        h.update(type(value).__name__.encode())
        feed(h, {k: v for k, v in vars(value).items() if not k.startswith("_")})
    else:
        h.update(repr(value).encode())


def digest(tree: Path, file: str, world: str, sizes: dict[str, int], simulate: bool) -> str:
    from dcpc.harness import synth
    from dcpc.harness.simulate import step_rounding
    from dcpc.harness.worker import CallSims
    from dcpc.lang.mesh import MeshWorld
    from dcpc.lang.parse import parse_file

    w = MeshWorld([int(x) for x in world.split("x")]) if "x" in world else int(world)
    schedule = parse_file(tree / file, world=w)
    ctor = synth.constructor_sizes(schedule, w, sizes)
    h = hashlib.sha256()
    feed(h, ctor)
    for seed in SEEDS:
        if simulate and seed == SEEDS[0]:
            sims = CallSims(schedule, w, ctor, seed, step_rounding(schedule, "local", "cuda"),
                            keep=True)
            for call in range(CALLS):
                feed(h, sims.get(call))
            continue
        for call in range(CALLS):
            got = synth.call_sizes(schedule, w, ctor, seed, call)
            feed(h, [got, synth.call_inputs(schedule, w, got, seed, call),
                     synth.make_external(schedule, w, got, seed, call)])
    return h.hexdigest()


def main() -> int:
    tree = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(tree))
    import dcpc

    if not Path(dcpc.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"reference_digest: imported {dcpc.__file__}, not {tree}'s dcpc")
    out = {}
    for file, world, sizes in json.load(sys.stdin):
        try:
            out[f"{file}@{world}"] = digest(tree, file, str(world), sizes,
                                            "--simulate" in sys.argv[2:])
        except Exception as exc:  # noqa: BLE001 - that tree cannot make the case: say so
            out[f"{file}@{world}"] = f"error: {type(exc).__name__}: {exc}"[:300]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
