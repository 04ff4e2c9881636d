"""Diagnostics: every user-facing failure is one of these, never a traceback.

A diagnostic names where (file:line:col, 1-based), what (one sentence) and, when a
fix is known, how (a hint). Stages collect them; the driver decides the exit code.
"""

from __future__ import annotations

import difflib
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field


def printable(text: str) -> str:
    """``text`` with every control or invisible format character escaped (``\\n``,
    ``\\x1b``, ``\\u202e``): a diagnostic is one line per entry, and a name from the
    input can neither forge a line nor reach the terminal as an escape sequence."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or ch == " ":
            out.append(ch)
        elif unicodedata.category(ch) in ("Zs",):  # odd spaces: visible enough
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def clipped(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters for a message (a 1 MiB value from the input
    would otherwise be quoted whole), saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True, order=True)
class Mark:
    """A position in a source file (1-based line and column)."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{printable(self.file)}:{self.line}:{self.col}"


NOWHERE = Mark("<unknown>", 0, 0)


@dataclass(frozen=True)
class Diagnostic:
    """One error or warning, with where, what and (optionally) how to fix it."""

    mark: Mark
    code: str  # a stable error class, e.g. "unknown-key"; tests and JSON output use it
    message: str
    hint: str | None = None
    severity: str = "error"
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        # the one place every message passes: escape what came from the input
        object.__setattr__(self, "message", printable(self.message))
        if self.hint is not None:
            object.__setattr__(self, "hint", printable(self.hint))
        object.__setattr__(self, "notes", tuple(printable(n) for n in self.notes))

    def render(self) -> str:
        lines = [f"{self.mark}: {self.severity}: {self.message} [{self.code}]"]
        lines += [f"  {note}" for note in self.notes]
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        return {
            "file": self.mark.file,
            "line": self.mark.line,
            "col": self.mark.col,
            "severity": self.severity,
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
            "notes": list(self.notes),
        }


class DiagnosticError(Exception):
    """Raised by a stage that cannot go on; carries every diagnostic found so far."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.mark, d.code))
        super().__init__("\n".join(d.render() for d in self.diagnostics))


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """A 'did you mean' hint for a misspelt name, or None when nothing is close."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None
