"""The receipt's output path, checked before a run starts: writable, not a folder, not taken by
another run (a lock file beside it, released at the end; a lock left by a dead process is ignored),
and never a device or FIFO that `--force` would replace."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from lora_parity.evidence.receipt_io import check_replaceable
from lora_parity.util.errors import ConfigError, ReceiptExistsError

MIN_FREE_BYTES = 16 * 1024 * 1024
"""Free space the output folder needs: real receipts are 100-140 KB; this leaves a wide margin."""


def lock_path(out: Path) -> Path:
    """The lock file of an output path: `<out>.lock`."""
    return out.with_name(out.name + ".lock")


def _existing_parent(out: Path) -> Path:
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def check_writable(out: Path, force: bool, option: str = "--out") -> None:
    """Raise a one-line `ConfigError` unless a file can be written at `out`: not a folder, not an
    existing file without `force`, nothing but a regular file with it (a device or FIFO is never
    replaced), its folder (or the nearest one that exists) writable and not full. `option` names
    the option in the message."""
    if out.is_dir():
        raise ConfigError(f"{option} {out} is a folder; give a file path")
    check_replaceable(out, option)
    if out.exists() and not force:
        raise ReceiptExistsError(f"{out} exists; pass --force to overwrite it")
    parent = _existing_parent(out)
    if not parent.is_dir():
        raise ConfigError(f"{option} {out}: {parent} is not a folder")
    try:
        free = shutil.disk_usage(parent).free
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".lora-parity-probe-") as probe:
            probe.write(b"\0")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        raise ConfigError(f"{option} {out}: {parent} is not writable ({e.strerror or e})") from None
    if free < MIN_FREE_BYTES:
        raise ConfigError(f"{option} {out}: only {free // 1024} KiB free in {parent} "
                          f"({MIN_FREE_BYTES // 2**20} MiB needed)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    except OSError:
        return False
    return True


def _holder(lock: Path) -> int | None:
    """The live process holding `lock`, or None when the lock is stale or unreadable."""
    try:
        pid = int(lock.read_text(encoding="ascii").strip() or "0")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return pid if pid > 0 and pid != os.getpid() and _alive(pid) else None


class OutLock:
    """The claim of one run on its output path; `release()` (idempotent) removes the lock file."""

    def __init__(self, out: Path) -> None:
        self.path = lock_path(out)
        self._held = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot create its folder ({e.strerror or e})") from None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _holder(self.path)
                if holder is not None:
                    raise ConfigError(f"--out {out}: another run (pid {holder}) is writing it; wait for it to "
                                      f"finish, or delete {self.path} if no run is") from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            except OSError as e:
                raise ConfigError(f"--out {out}: cannot create the lock {self.path} ({e.strerror or e})") from None
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(f"{os.getpid()}\n")
            self._held = True
            return
        raise ConfigError(f"--out {out}: another run keeps taking the lock {self.path}")

    def release(self) -> None:
        """Remove the lock file, if this process still holds it."""
        if self._held:
            self._held = False
            try:
                if self.path.read_text(encoding="ascii").strip() == str(os.getpid()):
                    self.path.unlink()
            except OSError:
                pass


def claim(out: Path, force: bool) -> OutLock:
    """Preflight of the output path: check it is writable, then lock it for this run. Call
    `release()` on the result when the run is over."""
    check_writable(out, force)
    return OutLock(out)
