"""Where the Jinja templates are: top-level templates/ in a checkout, or the installed
package ``dcpc._templates`` (pyproject maps templates/ to it)."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path


def template_dir() -> Path:
    checkout = Path(__file__).resolve().parents[2] / "templates"
    if (checkout / "module.py.j2").is_file():
        return checkout
    import dcpc._templates  # type: ignore[import-not-found]

    return Path(dcpc._templates.__path__[0])


@lru_cache(maxsize=1)
def generator_fingerprint() -> str:
    """sha256 of what turns a plan into module text: every template and the codegen's
    own sources. A cache of compiled modules keyed by schedule text alone would keep a
    module emitted by other templates (dcpc.engines keys by both)."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    files = sorted(template_dir().rglob("*.j2")) + sorted(here.glob("*.py"))
    for path in files:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()
