"""Start W processes in a gloo group, run one worker in each, never hang.

The worker is named by ``"module:function"`` and imported in the child after
``TRITON_INTERPRET=1`` is set (Triton reads it at import). Each child reports one
result (or its traceback) through a queue. The parent waits until a deadline;
once one rank fails it gives the others ``grace_s`` more, then kills whatever is
left and reports which ranks hung, which died, and which failed. A worker may say
what it is doing (``progress``): a killed rank is reported with its last words
("killed while in call 3 (slot 0): out_exchange()").
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from dcpc.runtime.clock import wall_timeout

PROGRESS_ENV = "DCPC_PROGRESS_FILE"
# A rank that has said nothing yet is still starting (spawn, import torch and triton:
# seconds on an idle machine, a minute on a loaded one): its stall clock starts at its
# first words, or after this long.
STARTUP_S = 120.0
_progress_fd: int | None = None


def progress(text: str) -> None:
    """Record what this rank is doing now (read by the parent if it must kill the rank)."""
    global _progress_fd
    path = os.environ.get(PROGRESS_ENV)
    if not path:
        return
    if _progress_fd is None:
        _progress_fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    data = text.encode("utf-8", "replace")[:400]
    os.pwrite(_progress_fd, data.ljust(400), 0)


def _last_words(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


@dataclass
class RankOutcome:
    rank: int
    status: str  # "ok" | "error" | "died" | "hung" | "timeout" (progressing at the deadline)
    value: Any = None  # the worker's return value when ok
    error: str = ""  # exception type and message, or why it died
    traceback: str = ""
    exitcode: int | None = None
    reported_s: float | None = None  # seconds from launch to this rank's report


@dataclass
class LaunchResult:
    world: int
    outcomes: list[RankOutcome]
    wall_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.status == "ok" for o in self.outcomes)

    def ranks(self, status: str) -> list[int]:
        return [o.rank for o in self.outcomes if o.status == status]

    def values(self) -> list[Any]:
        return [o.value for o in self.outcomes]

    def summary(self) -> str:
        parts = []
        for o in self.outcomes:
            text = f"rank {o.rank}: {o.status}"
            if o.status != "ok":
                text += f" ({o.error})" if o.error else ""
            parts.append(text)
        return "; ".join(parts)


def _child_main(
    rank: int,
    world: int,
    store_path: str,
    worker: str,
    args: dict[str, Any],
    results: Any,
    gloo_timeout_s: float,
    environ: dict[str, str] | None = None,
    path: list[str] | None = None,
    interpret: bool = True,
) -> None:
    if environ is not None:  # forked from the fork server: the launcher's environment now
        os.environ.clear()
        os.environ.update(environ)
    if path is not None:
        sys.path[:] = path
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[PROGRESS_ENV] = f"{store_path}.progress{rank}"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=gloo_timeout_s),
        )
        # every rank's connections are up before any worker runs: a rank whose worker
        # returns at once would otherwise leave (os._exit below) while a peer still
        # connects, and that peer would report gloo's "Connection closed by peer"
        # instead of its own outcome (bounded by gloo_timeout_s like the init)
        dist.barrier()
        module_name, _, func_name = worker.partition(":")
        func = getattr(importlib.import_module(module_name), func_name)
        value = func(rank, world, **args)
        results.put((rank, "ok", value, "", ""))
    except BaseException as exc:  # noqa: BLE001 (reported to the parent, never swallowed)
        results.put((rank, _status(exc), None, f"{type(exc).__name__}: {exc}",
                     traceback.format_exc()))
    # No destroy_process_group: a peer may be gone, and gloo teardown would block.
    # Flush the queue, then leave at once (skips atexit hooks that could wait on peers).
    results.close()
    results.join_thread()
    os._exit(0)


# Children start from a fork server that imported these once (torch and triton take 2 to
# 3 s of CPU per process to import; a run starts W of them), and what every rank would
# otherwise import or compute again in every run (dcpc.harness.forkwarm): DCPC_LAUNCH=spawn
# starts each child from scratch instead. Either way a child gets the launcher's
# environment and sys.path of the moment it is started (``_child_main``), but what the
# fork server preloaded (dcpc included) comes from where the server found it: its
# working directory, PYTHONPATH, the installed tree (Python 3.11's forkserver ignores
# the launcher's sys.path).
PRELOAD = ["torch", "torch.distributed", "triton", "dcpc.harness.worker",
           "dcpc.harness.forkwarm"]


def _status(exc: BaseException) -> str:
    """The status of a process that raised ``exc``: "error", or what the exception says it
    stands for (``launch_status``: dcpc.runtime.local's LocalRankHang "hung",
    LocalRankTimeout "timeout", the ranks of a ``local`` run's one process)."""
    status = getattr(type(exc), "launch_status", "error")
    return status if status in ("hung", "timeout") else "error"


def _context(interpret: bool = True) -> Any:
    """The fork server preloads Triton with its interpreter on: a run on a GPU (the
    compiled kernels) starts every child from scratch instead."""
    if not interpret or os.environ.get("DCPC_LAUNCH", "forkserver") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def launch(
    worker: str,
    world: int,
    args: dict[str, Any] | None = None,
    *,
    timeout_s: float = 120.0,
    grace_s: float = 10.0,
    gloo_timeout_s: float = 60.0,
    stall_s: float | None = None,
    env: dict[str, str] | None = None,
    interpret: bool = True,
) -> LaunchResult:
    """Run ``worker(rank, world, **args)`` in ``world`` spawned processes.

    ``timeout_s`` bounds the whole run. With ``stall_s``, the ranks' ``progress`` is also
    watched: when no rank still running has said anything new, and none ended, for
    ``stall_s`` seconds, they are killed as ``hung``; ranks still progressing at
    ``timeout_s`` are killed as ``timeout`` (a slow run, not a hang: a larger timeout
    lets it finish). A rank that
    has said nothing yet is starting, not stalled, for ``STARTUP_S``. ``stall_s`` and
    ``grace_s`` count the progress a busy thread makes (``wall_timeout``: on a loaded
    machine more wall seconds), as the ranks' own waits do. ``env``: the
    children's environment (default: the launcher's of the moment). ``interpret``: the
    children run Triton's interpreter (CPU); False for the compiled kernels on a GPU."""
    ctx = _context(interpret)
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="dcpc-launch-")
    store = os.path.join(tmp, "store")
    procs = [
        ctx.Process(
            target=_child_main,
            args=(rank, world, store, worker, args or {}, results, gloo_timeout_s,
                  dict(os.environ if env is None else env), list(sys.path), interpret),
            name=f"dcpc-rank{rank}",
            daemon=True,
        )
        for rank in range(world)
    ]
    start = time.monotonic()
    outcomes: dict[int, RankOutcome] = {}
    notes: list[str] = []
    try:
        # the children's environment from their first line: spawn imports the worker's
        # module (and with it triton) before _child_main runs, and Triton reads
        # TRITON_INTERPRET at import
        saved = os.environ.get("TRITON_INTERPRET")
        if interpret:
            os.environ["TRITON_INTERPRET"] = "1"
        else:
            os.environ.pop("TRITON_INTERPRET", None)
        try:
            for p in procs:
                p.start()
        finally:
            if saved is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = saved
        deadline = cap = start + timeout_s
        said = [""] * world  # each rank's last progress text, and when it changed
        changed = [start] * world
        ended: set[int] = set()  # the ranks whose outcome counted as their progress
        looked = start
        while len(outcomes) < world and time.monotonic() < deadline:
            now = time.monotonic()
            for rank in outcomes.keys() - ended:  # an end is progress: a peer that waited
                ended.add(rank)  # on it silently is not stale
                changed[rank] = now
            if stall_s is not None and now - looked >= 1.0:
                looked = now
                for rank in range(world):
                    text = _last_words(f"{store}.progress{rank}")
                    if text != said[rank] or (not text and now - start < STARTUP_S):
                        said[rank], changed[rank] = text, now
                last = max(changed)  # ended ranks too: their end moved
                # the ranks' own waits end on their CPU time (dcpc.runtime.clock): on a
                # loaded machine a stall is as many seconds of the progress a busy
                # thread makes now, not of the wall (sampled only when it may be one)
                if now - last >= stall_s and (
                        time.monotonic() - last >= wall_timeout(stall_s)):
                    break  # nobody moved or ended for stall_s: a hang
            try:
                rank, status, value, error, tb = results.get(timeout=0.1)
                outcomes[rank] = RankOutcome(rank, status, value, error, tb,
                                             reported_s=time.monotonic() - start)
                if status != "ok":  # the others' grace, in progress as their waits
                    deadline = min(deadline, time.monotonic() + wall_timeout(grace_s))
                continue
            except queue.Empty:
                pass
            exited = [
                r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None
            ]
            if exited:
                _drain(results, outcomes)  # a report may still be in the pipe
            for rank in exited:
                if rank not in outcomes:
                    code = procs[rank].exitcode
                    outcomes[rank] = RankOutcome(
                        rank, "died", error=f"exited with code {code} before reporting",
                        exitcode=code,
                    )
                    deadline = min(deadline, time.monotonic() + wall_timeout(grace_s))
        _drain(results, outcomes)
        now = time.monotonic()
        for rank in range(world):
            if rank not in outcomes:
                doing = _last_words(f"{store}.progress{rank}")
                where = f" while in {doing}" if doing else ""
                if stall_s is not None and now >= cap and now - changed[rank] < stall_s:
                    outcomes[rank] = RankOutcome(
                        rank, "timeout",
                        error=f"timed out after {now - start:.1f} s (still progressing); "
                        f"killed{where} (not a hang: a larger timeout lets it finish)",
                    )
                    continue
                quiet = f" (nothing new for {now - changed[rank]:.0f} s)" if stall_s else ""
                outcomes[rank] = RankOutcome(
                    rank, "hung",
                    error=f"no result after {now - start:.1f} s{quiet}; killed{where}",
                )
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(5)
        for rank, p in enumerate(procs):
            if rank in outcomes and p.pid is not None:
                outcomes[rank].exitcode = p.exitcode
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return LaunchResult(world, [outcomes[r] for r in range(world)], time.monotonic() - start, notes)


def _drain(results: Any, outcomes: dict[int, RankOutcome]) -> bool:
    """Move every queued report into ``outcomes``; True if any arrived."""
    got = False
    while True:
        try:
            rank, status, value, error, tb = results.get_nowait()
        except queue.Empty:
            return got
        outcomes[rank] = RankOutcome(rank, status, value, error, tb)
        got = True
