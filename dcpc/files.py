"""Reading schedules and writing outputs: every I/O failure is a diagnostic.

Inputs must be regular files and are read up to a size cap (``/dev/zero`` or a FIFO
would otherwise read forever or block). Outputs are written atomically: a temporary
file in the target's folder, then a rename, so a full disk or a killed process never
leaves a truncated module that still parses. I/O diagnostics carry the code ``io``;
the command line exits 2 on them (a usage error, not a schedule error).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from dcpc.diagnostics import Diagnostic, DiagnosticError, Mark

IO = "io"
_KINDS = {
    stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link",
}


def _reason(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, "") or str(exc)


def io_error(path: str | Path, what: str, hint: str | None = None) -> DiagnosticError:
    """An I/O failure about ``path`` as a whole (located at its line 1, column 1)."""
    return DiagnosticError([Diagnostic(Mark(str(path), 1, 1), IO, what, hint=hint)])


def read_capped(path: str | Path, cap: int) -> bytes:
    """The bytes of a regular file; refuse anything else, and files above ``cap``."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; no effect on files
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        hint = "check the path" if exc.errno == errno.ENOENT else None
        raise io_error(path, f"cannot read the file: {_reason(exc)}", hint) from None
    try:
        info = os.fstat(fd)
        mode = info.st_mode
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
            raise io_error(path, f"cannot read the schedule: it is {kind}, not a regular file")
        if info.st_size > cap:  # refused unread (the loop below bounds one that grows)
            raise _too_large(path, cap)
        chunks, left = [], cap + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise io_error(path, f"cannot read the file: {_reason(exc)}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:
        raise _too_large(path, cap)
    return data


def _too_large(path: Path, cap: int) -> DiagnosticError:
    return DiagnosticError([Diagnostic(
        Mark(str(path), 1, 1), "too-large", f"the file is larger than {cap} bytes")])


def write_atomically(path: str | Path, text: str, *, make_parents: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename.

    Raises DiagnosticError (code ``io``) naming the path and the system's reason.
    """
    path = Path(path)
    folder = path.parent
    try:
        if make_parents:
            folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir():
            raise io_error(path, f"cannot write the file: the folder '{folder}' does not exist",
                           hint="create it first, or write somewhere else")
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise io_error(path, f"cannot write the file: {_reason(exc)}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise io_error(path, f"cannot write the file: {_reason(exc)}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
