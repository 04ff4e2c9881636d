"""Whether two trees' kernels are the same on the GPU: PTX for sm_90 of every kernel
variant the sweep captures (dcpc.harness.ptx: every file of schedules/, gallery/ and ops/
at W = 2, mesh files at 2x2), each tree compiled by its own dcpc, compared with the
debug lines (.loc, .file, the .debug sections, comments) aside. The evidence for a
"runtime" pair of benchmarks/results/gpu_equivalent.json when a change to
dcpc/runtime leaves the GPU's code alone (session 35: the wait's CPU branch).

    python3 -m benchmarks.ptx_compare TREE_A TREE_B [--keep DIR]
        # TREE: a checkout or a commit's `git archive` unpacked; CPU only, minutes each

Each tree runs in a child process with the tree first on its path and as its working
directory (the fork server imports from there). Variants are compared as sets per file
(the capture's launch order follows the threads' interleaving).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DUMP = r'''
import json, sys, tempfile
from pathlib import Path
from dcpc.harness import ptx
from dcpc.harness.launch import launch
from dcpc.lang.mesh import MeshWorld


def main():
    root, out = Path(sys.argv[1]), sys.argv[2]
    files = [p for folder in ("schedules", "schedules/gallery", "schedules/ops")
             for p in sorted((root / folder).glob("*.yaml"))]
    cases = [(p, MeshWorld([2, 2]) if "\nmesh:" in p.read_text() else 2) for p in files]
    with tempfile.TemporaryDirectory() as tmp:
        runs = ptx._runs(cases, Path(tmp), 3, 2, ())
        captured = ptx._capture(runs, reference=False, timeout_s=3600)
        # the GPU's CLOCK: a tree whose compile_ptx keeps the CPU's value compiles this
        captured = [[(n, a, tuple((k, ("value", True)) if k == "CLOCK" else (k, v)
                                  for k, v in kw)) for n, a, kw in per] for per in captured]
        done = launch("dcpc.harness.ptx:compile_ptx", 1, {
            "modules": [r["module_path"] for r in runs], "launches": captured},
            timeout_s=3600, interpret=False)
        (got,) = done.outcomes
        if got.status != "ok":
            raise SystemExit(f"compiling failed: {got.error}")
    json.dump({str(p.relative_to(root)): per for p, per in zip(files, got.value)},
              open(out, "w"))


if __name__ == "__main__":
    main()
'''


def _normal(ptx: str) -> str:
    lines, debug = [], False
    for line in ptx.splitlines():
        s = line.strip()
        debug = debug or (s.startswith(".section") and ".debug" in s)
        if not debug and s and not s.startswith((".loc", ".file", "//")):
            lines.append(line)
    return "\n".join(lines)


def dump(tree: Path, out: Path) -> dict[str, dict[str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ptx_dump.py"
        script.write_text(DUMP)
        env = {**os.environ, "PYTHONPATH": str(tree), "TRITON_INTERPRET": "1"}
        subprocess.run([sys.executable, str(script), str(tree), str(out)], cwd=tree,
                       env=env, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs=2, type=Path)
    parser.add_argument("--keep", type=Path, help="keep each tree's PTX JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        a, b = (dump(t.resolve(), where / f"ptx_{i}.json") for i, t in enumerate(args.trees))
    if a.keys() != b.keys():
        raise SystemExit(f"the trees' files differ: {sorted(set(a) ^ set(b))}")
    total = same = 0
    differ = []
    for name in a:
        va = {(k.split("#")[0], _normal(v)) for k, v in a[name].items()}
        vb = {(k.split("#")[0], _normal(v)) for k, v in b[name].items()}
        total += len(va | vb)
        same += len(va & vb)
        if va != vb:
            differ.append(name)
    launches = sum(len(v) for v in a.values())
    spins = sum(1 for v in a.values() for p in v.values() if "globaltimer" in p)
    print(f"{len(a)} files, {launches} launches ({spins} with the GPU's spin), "
          f"{total} distinct kernel variants: {same} identical in both trees")
    print("differ: " + (", ".join(differ) if differ else "none"))
    raise SystemExit(1 if differ else 0)


if __name__ == "__main__":
    main()
