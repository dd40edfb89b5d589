"""Where an exception was raised, for a receipt: type, message and the innermost frames, with paths
relative to the package's parent or to site-packages, never a machine path."""

from __future__ import annotations

import traceback
from pathlib import Path

from lora_parity.evidence.receipt import ErrorDetail
from lora_parity.util.errors import LoraParityError

MAX_FRAMES = 5
"""Innermost frames kept."""
_PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # lora_parity/evidence/tracebacks.py


def relative_path(filename: str) -> str:
    """'vllm/v1/engine/core.py' for a file under site-packages (or dist-packages), 'lora_parity/x.py'
    for one of this package, else the file's name alone."""
    normalized = filename.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in normalized:
            return normalized.rsplit(marker, 1)[1]
    try:
        return Path(filename).resolve().relative_to(_PACKAGE_PARENT).as_posix()
    except (ValueError, OSError):
        return Path(normalized).name


def frames(error: BaseException, limit: int = MAX_FRAMES) -> list[str]:
    """The innermost `limit` frames of `error`'s traceback, innermost last, as 'path:line function'."""
    summary = traceback.extract_tb(error.__traceback__)[-limit:]
    return [f"{relative_path(f.filename)}:{f.lineno} {f.name}" for f in summary]


def describe(error: BaseException, where: str) -> ErrorDetail:
    """The receipt's record of `error`, raised in `where` ('setup' or a phase)."""
    return ErrorDetail(where=where, type=type(error).__name__, message=str(error), frames=frames(error))


def one_line(error: BaseException) -> str:
    """The error in one line: a lora-parity error's own message; any other: its type and message,
    and where it was raised (the innermost frame), since a bare AssertionError says nothing else."""
    if isinstance(error, LoraParityError):
        return str(error)
    innermost = frames(error, 1)
    at = f" (at {innermost[0]})" if innermost else ""
    return f"{type(error).__name__}: {error}{at}"
