"""A schedule written into a test's folder, and what the pipeline says of it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from dcpc import pipeline
from dcpc.diagnostics import DiagnosticError


def write(folder: Path, text: str, name: str = "schedule.yaml") -> Path:
    """``text`` as ``folder/name`` (the name shows in located messages)."""
    path = folder / name
    path.write_text(text)
    return path


def errors(path: Path, worlds: Sequence[int] = (2, 3)) -> list[tuple[str, int, int, str]]:
    """(code, line, col, message) of every diagnostic of a schedule the pipeline refuses
    (the test fails if it accepts it)."""
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(path, pipeline.Options(worlds=tuple(worlds)))
    return [(d.code, d.mark.line, d.mark.col, d.message) for d in err.value.diagnostics]


def codes(source: str, folder: Path, name: str = "schedule.yaml",
          worlds: Sequence[int] = (2, 3)) -> list[str]:
    """The error codes the pipeline reports up to the happens-before check, sorted and
    each once (empty: accepted and proved)."""
    try:
        pipeline.run(write(folder, source, name), pipeline.Options(worlds=tuple(worlds)),
                     until="hb")
    except DiagnosticError as err:
        return sorted({d.code for d in err.diagnostics if d.severity == "error"})
    return []
