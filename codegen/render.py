"""Kernel sources from jinja2 templates: each family keeps its own templates/ folder, and its
digest (the templates and the csrc/ headers its sources include) keys that family's tuning
decisions and builds, so editing one family's template retunes that family only."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import jinja2

CSRC = Path(__file__).resolve().parent.parent / "csrc"  # installed: torch_xaccel/csrc; a checkout: ./csrc


class Templates:
    """One family's templates/ folder (and the csrc/ folders its sources include)."""

    def __init__(self, folder: Path, csrc: tuple[str, ...] = ()):
        self.folder = Path(folder)
        self.csrc = tuple(CSRC / c for c in csrc)
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(self.folder)), trim_blocks=True,
                                      lstrip_blocks=True, keep_trailing_newline=True,
                                      undefined=jinja2.StrictUndefined)

    def render(self, template: str, **values) -> str:
        return self.env.get_template(template).render(**values)

    @functools.cached_property
    def digest(self) -> str:
        """Changes whenever one of the family's templates or included headers changes."""
        h = hashlib.sha256()
        files = sorted(self.folder.glob("*.jinja")) + sorted(p for d in self.csrc for p in d.glob("*") if p.is_file())
        for p in files:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        return h.hexdigest()[:12]
