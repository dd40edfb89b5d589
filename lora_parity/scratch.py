"""Scratch folders that must outlive one call but not the run: made here, removed by `remove_all`
when the backends are closed (or left to the process exit), on every path, an interrupt included."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

_folders: list[Path] = []


def folder(prefix: str) -> Path:
    """A new folder in the temp dir, removed by the next `remove_all`."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _folders.append(path)
    return path


def remove_all() -> None:
    """Remove every folder made by `folder` (nothing may use them any more)."""
    while _folders:
        shutil.rmtree(_folders.pop(), ignore_errors=True)
