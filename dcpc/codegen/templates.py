"""Where the Jinja templates are: top-level templates/ in a checkout, or the installed
package ``dcpc._templates`` (pyproject maps templates/ to it)."""

from __future__ import annotations

from pathlib import Path


def template_dir() -> Path:
    checkout = Path(__file__).resolve().parents[2] / "templates"
    if (checkout / "module.py.j2").is_file():
        return checkout
    import dcpc._templates  # type: ignore[import-not-found]

    return Path(dcpc._templates.__path__[0])
