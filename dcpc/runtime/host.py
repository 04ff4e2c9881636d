"""HostHeap: symmetric memory for the CPU backend, shared between processes.

One /dev/shm segment per rank holds every buffer of an ``allocate`` call (256-byte
aligned offsets). Segment names go round the group (gloo ``all_gather_object``),
every rank maps every peer's segment, a barrier, and then every rank unlinks its
own segment at once: the mappings stay valid, and nothing is left in /dev/shm even
if a process crashes later. A rank killed before that (during construction) leaves its
segment behind; segment names carry the creator's PID namespace, PID and start time,
so that ``remove_orphan_segments`` (run by every HostHeap construction and by
``dcpc run``) can remove exactly the segments whose creator is gone.

Peer addresses are this process's addresses, so Triton kernels under
``TRITON_INTERPRET=1`` store into peers through ``peer_ptrs``; without it the kernels
would need a GPU driver, so construction refuses and says how to set it.

Imports torch, the standard library and dcpc.runtime.heap only (never the compiler).
"""

from __future__ import annotations

import os
import re
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dcpc.runtime.heap import Segment, SymmetricBuffer, aligned_offsets

SHM_DIR = "/dev/shm"  # the default; DCPC_SHM_DIR names another (a tmpfs) folder
SEGMENT_PREFIX = "dcpc-"
# dcpc-<pid namespace>-<pid>-<start time of the pid>-<random>
_SEGMENT_NAME = re.compile(rf"^{SEGMENT_PREFIX}(\d+)-(\d+)-(\d+)-[0-9a-f]{{12}}$")


def shm_dir() -> str:
    """Where segments are created and orphans looked for: $DCPC_SHM_DIR, else /dev/shm.

    A run (or a test) that must not meet other runs' segments names its own folder.
    """
    return os.environ.get("DCPC_SHM_DIR") or SHM_DIR


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot); None if it is gone.

    Where /proc is missing the time is 0 and only the PID's existence is checked.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22 of stat(5); fields[0] is field 3
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def segment_prefix(pid: int | None = None) -> str:
    """The name prefix of every segment process ``pid`` (default: this one) creates."""
    pid = os.getpid() if pid is None else pid
    return f"{SEGMENT_PREFIX}{_pid_namespace()}-{pid}-{_start_time(pid) or 0}-"


def remove_orphan_segments(folder: str | None = None) -> list[str]:
    """Unlink the segments in ``folder`` (default: ``shm_dir()``) whose creating process
    no longer exists; return their names.

    Only names of this format, from this PID namespace, are considered: a PID that is
    gone, or now belongs to a process that started later, marks an orphan. Segments of
    live processes (another run in progress) are never touched.
    """
    removed: list[str] = []
    folder = shm_dir() if folder is None else folder
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    namespace = _pid_namespace()
    for name in names:
        found = _SEGMENT_NAME.match(name)
        if found is None or int(found[1]) != namespace:
            continue
        pid, started = int(found[2]), int(found[3])
        now = _start_time(pid)
        if now is None or (started and now and now != started):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass  # removed by someone else meanwhile, or not ours to remove
    return removed


def _process_of(path: str) -> tuple[int, int] | None:
    """(pid, start time) of the process that created segment ``path``, or None when its
    name is not ours or it was made in another PID namespace (its PID means nothing here)."""
    found = _SEGMENT_NAME.match(os.path.basename(path))
    if found is None or int(found[1]) != _pid_namespace():
        return None
    return int(found[2]), int(found[3])


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Mappings:
    """The mapped segments of one heap; what the finalizer releases."""

    def __init__(self) -> None:
        self.segments: list[list[torch.Tensor]] = []  # per allocate call: [W] uint8 maps
        self.own_paths: list[str] = []  # created but maybe not yet unlinked

    def release(self) -> None:
        for path in self.own_paths:
            _unlink_quietly(path)
        self.own_paths.clear()
        self.segments.clear()  # torch unmaps a segment when its last tensor goes


class HostHeap:
    """Symmetric heap in POSIX shared memory for ranks on one host (CPU backend)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: str | torch.device = "cpu",
        poison: bool = False,
    ):
        self.shm_dir = shm_dir()
        if not os.path.isdir(self.shm_dir):
            raise ValueError(
                f"HostHeap creates its segments in {self.shm_dir!r} (DCPC_SHM_DIR or "
                f"{SHM_DIR}), which is not a folder")
        if not dist.is_initialized():
            raise RuntimeError("HostHeap needs torch.distributed initialized (gloo)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise ValueError(f"HostHeap lives in host memory; device {self.device} is not cpu")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend 'host' runs the Triton kernels under Triton's CPU interpreter: set "
                "TRITON_INTERPRET=1 in the environment before the generated module (or "
                "triton) is imported, e.g. TRITON_INTERPRET=1 python your_engine.py")
        self.poison = poison
        self.closed = False
        # per heap rank: (pid, start time) of its process, from its segment's name (the
        # first allocate), when it runs in this PID namespace: ``gone`` asks /proc
        self.processes: list[tuple[int, int] | None] = []
        self._maps = _Mappings()
        # runs on close(), on garbage collection, and at interpreter exit
        self._finalizer = weakref.finalize(self, self._maps.release)
        remove_orphan_segments(self.shm_dir)  # what ranks killed in an earlier construction left

    def allocate(
        self, nbytes: Sequence[int], *, poison: bool | None = None
    ) -> list[SymmetricBuffer]:
        """Collective: every rank calls with the same list. One segment per rank.

        ``poison`` overrides the heap's setting for this call (an extension of the
        protocol, for callers that want a zeroed signal bank on a poisoned heap).
        """
        if self.closed:
            raise RuntimeError("allocate on a closed HostHeap")
        sizes = [int(n) for n in nbytes]
        if any(n < 0 for n in sizes):
            raise ValueError(f"negative buffer size in {sizes}")
        offsets, total = aligned_offsets(sizes)
        fill = self.poison if poison is None else poison

        path = self._create_segment(total, fill)
        names: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(names, (path, total), group=self.group)
            for peer, (_, peer_total) in enumerate(names):
                if peer_total != total:
                    raise RuntimeError(
                        f"allocate called with different sizes: rank {self.rank} has "
                        f"{total} bytes, rank {peer} has {peer_total}"
                    )
            maps = [
                torch.from_file(p, shared=True, size=total, dtype=torch.uint8)
                for p, _ in names
            ]
            dist.barrier(group=self.group)  # every rank has mapped every segment
        finally:
            _unlink_quietly(path)
            self._maps.own_paths.remove(path)
        self._maps.segments.append(maps)

        if not self.processes:
            self.processes = [_process_of(p) for p, _ in names]
        bases = [int(m.data_ptr()) for m in maps]
        local = maps[self.rank]
        return [
            Segment(
                local[off : off + n],
                torch.tensor([b + off for b in bases], dtype=torch.int64),
            )
            for off, n in zip(offsets, sizes, strict=True)
        ]

    def _create_segment(self, total: int, poison: bool) -> str:
        path = os.path.join(self.shm_dir, f"{segment_prefix()}{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._maps.own_paths.append(path)  # unlinked by the finalizer if we die early
        try:
            os.ftruncate(fd, total)
            if poison:
                os.pwrite(fd, b"\xff" * total, 0)
        finally:
            os.close(fd)
        return path

    def gone(self, rank: int) -> bool:
        """Whether heap rank ``rank``'s process no longer runs (killed, crashed, exited):
        its PID is gone or now belongs to a later process. False when it cannot be seen
        (another PID namespace)."""
        found = self.processes[rank] if 0 <= rank < len(self.processes) else None
        if found is None:
            return False
        pid, started = found
        now = _start_time(pid)
        return now is None or bool(started and now and now != started)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Drop this heap's mappings (idempotent). Views handed out stay valid."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()

    def __enter__(self) -> HostHeap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._maps.segments)} segments"
        return f"HostHeap(rank={self.rank}, world={self.world}, {state})"
