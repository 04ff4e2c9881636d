"""Time `dcpc check --world 2..1024` on the small files of issue 22 item 9, on the
shipped schedules and on the gallery, as a user runs it (a fresh process: imports
included); plus the widest accepted range of the per-W loop file (ring_attention,
2..42) and of the mesh files (1..8x2..8: their axis sizes are at most 8), and a mesh
of 1024 ranks (refused at once).

    python benchmarks/check_time.py [--code DIR] [--timeout 120] [--out FILE.md]

``--code`` runs another checkout's dcpc (e.g. an export of the previous commit) on
the same files, for before/after figures. Each file's wall time and CPU time (user +
system of the child) are reported; CPU time is the figure to compare on a shared
machine, where wall time depends on the other load.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FULL = "2..1024"
GALLERY = ROOT / "schedules" / "gallery"
FILES = sorted((ROOT / "benchmarks" / "check_time").glob("*.yaml")) + sorted(
    (ROOT / "schedules").glob("*.yaml"))
# The mesh files (a top-level `mesh:` key; read as text: the benchmark times the parse)
MESHES = sorted(p for p in GALLERY.glob("*.yaml")
                if re.search(r"^mesh:", p.read_text(), re.M))
CASES: list[tuple[Path, str]] = (
    [(p, FULL) for p in FILES + sorted(set(GALLERY.glob("*.yaml")) - set(MESHES))]
    + [(GALLERY / "ring_attention.yaml", "2..42")]
    + [(p, w) for p in MESHES for w in ("1..8x2..8", "2x512")])


def measure(code: Path, path: Path, worlds: str | None,
            timeout: float) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, outcome) of one `dcpc check` run (``worlds`` None:
    the default)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    try:
        asked = ["--world", worlds] if worlds is not None else []
        done = subprocess.run([sys.executable, "-m", "dcpc", "check", *asked, str(path)],
                              capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=code)
        last = (done.stdout + done.stderr).strip().splitlines()
        codes = sorted({line.rsplit("[", 1)[1].rstrip("]") for line in last
                        if ": error:" in line and line.endswith("]")})
        outcome = "ok" if done.returncode == 0 else f"exit {done.returncode}: " + ", ".join(codes)
    except subprocess.TimeoutExpired:
        outcome = f"still running at {timeout:.0f} s (killed)"
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, outcome


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--code", type=Path, default=ROOT)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", str(args.code), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or args.code.name
    load = os.getloadavg()
    lines = [
        f"date {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, code {commit} "
        f"({args.code}), machine {platform.node()} ({os.cpu_count()} CPUs, "
        f"load {load[0]:.1f} at start), python {platform.python_version()}",
        "", "| file | --world | bytes | wall s | CPU s | outcome |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for path, worlds in CASES:
        wall, cpu, outcome = measure(args.code, path, worlds, args.timeout)
        lines.append(f"| {path.relative_to(ROOT)} | {worlds} | {path.stat().st_size} | "
                     f"{wall:.1f} | {cpu:.2f} | {outcome} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
