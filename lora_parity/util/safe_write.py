"""One way to write a file the tool makes (a config from `init`, a report and its plots, a keypair): regular
files only, never through a symbolic link, never onto a device, a FIFO or a folder, through an unpredictable
temporary file in the same folder (created exclusively) and a rename, so a reader sees the old file or the new."""

from __future__ import annotations

import io
import os
import stat
import tempfile
from pathlib import Path

from lora_parity.util.errors import ConfigError


def check_replaceable(path: Path) -> None:
    """Refuse `path` where something other than a regular file sits there (a symbolic link, a device, a FIFO,
    a folder): writing would follow the link or replace what a user never meant to lose. Nothing there is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"{path}: cannot inspect it: {e.strerror or e}") from None
    if stat.S_ISLNK(mode):
        raise ConfigError(f"{path} is a symbolic link; refusing to write through it")
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path} is not a regular file (a device, a FIFO or a folder); refusing to replace it")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path, data: str | bytes, mode: int | None = None) -> Path:
    """Write `data` (text as UTF-8) to `path` through `check_replaceable`, an exclusive temporary file of an
    unpredictable name beside it, fsync and a rename. `mode`: the file's permissions (default 0666 less the
    umask). Raises OSError where the folder cannot take it (nothing is left behind)."""
    path = Path(path)
    check_replaceable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fchmod(f.fileno(), mode if mode is not None else 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_png(path: Path, figure: object) -> Path:
    """A matplotlib figure saved as PNG to `path` the same way (rendered in memory first)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", metadata={"Software": None})  # type: ignore[attr-defined]
    return write_atomic(path, buffer.getvalue())
