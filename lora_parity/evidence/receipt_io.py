"""Reading and writing receipt files safely: bytes and JSON only, no receipt models (see receipt.py).

Reading takes only regular files, with a size bound checked before and while reading, so `/dev/zero`,
a FIFO or a huge file is refused at once (`safe_read`, the reader of every file lora-parity opens).
JSON is parsed strictly: duplicate keys, NaN/Infinity and numbers that overflow to infinity are
refused with a one-line message that names the field.
Writing is atomic, never replaces anything but a regular file, and never loses a finished receipt:
one whose path was taken during the run goes beside it under a free name, and one that cannot be
written where asked goes to the temp folder; either is printed. Files are written with the mode a
plain `open` gives (0644 under umask 022), so a shared CI runner's other users can read them.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from lora_parity.util.errors import ConfigError, ReceiptError, ReceiptExistsError
from lora_parity.util.safe_read import read_bytes

MAX_RECEIPT_BYTES = 64 * 1024 * 1024
"""Largest receipt file `verify` reads. Real receipts are 100-140 KB (the largest committed one,
GPU runs included, is 133 KB); 64 MiB leaves a margin of about 500x and reads in seconds."""


def read_bounded(path: Path, limit: int = MAX_RECEIPT_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; `ReceiptError` (one line) otherwise
    (`safe_read.read_bytes`: a device, a FIFO or a huge file is refused at once)."""
    return read_bytes(Path(path), limit, ReceiptError, "a receipt")


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed in a receipt")


def one_line(text: str, limit: int = 160) -> str:
    """Text from a hostile file, escaped onto one printable line."""
    return text.encode("unicode_escape").decode("ascii")[:limit]


def nonfinite_field(data: Any) -> str | None:
    """The dotted path of the first non-finite float in `data`, or None."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return where or "(top)"
        if isinstance(node, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((f"{where}.{i}" if where else str(i), v) for i, v in reversed(list(enumerate(node))))
    return None


def parse_json(raw: bytes, name: str) -> tuple[str, dict[str, Any]]:
    """Decode UTF-8 and parse a JSON object strictly; return the text and the data."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReceiptError(f"{name}: not UTF-8 (byte {e.start})") from None
    overflowed: list[bool] = []

    def finite_float(s: str) -> float:
        x = float(s)
        if not math.isfinite(x):
            overflowed.append(True)
        return x

    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=finite_float,
                          object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise ReceiptError(f"{name}: duplicate key {one_line(repr(str(e)))}") from None
    except (ValueError, RecursionError) as e:
        raise ReceiptError(f"{name}: not valid JSON ({one_line(str(e), 120)}); truncated or corrupted?") from None
    if not isinstance(data, dict):
        raise ReceiptError(f"{name}: a receipt is a JSON object")
    if overflowed:
        raise ReceiptError(f"{name}: {one_line(nonfinite_field(data) or '(top)')}: a number too large for a float")
    return text, data


def umask_mode(mode: int = 0o666) -> int:
    """`mode` as the umask leaves it: what `open(path, "w")` would give a new file."""
    try:  # read without changing it (os.umask sets it, for a moment, process-wide)
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return mode & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mode & ~mask


def check_replaceable(path: Path, what: str = "--out") -> None:
    """`ConfigError` if `path` exists as anything but a regular file (a device, a FIFO, a socket):
    lora-parity replaces only regular files (`/dev/full` stays a device)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise ConfigError(f"{what} {path} is not a regular file; lora-parity replaces only regular files")


def _link_or_replace(tmp: str, path: Path, force: bool) -> None:
    """Put `tmp` at `path`: replacing a regular file with `force`, else only where nothing is (a hard
    link fails on an existing name, atomically; a file system without hard links gets a check first)."""
    if force:
        check_replaceable(path)
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise ReceiptExistsError(f"{path} exists; pass --force to overwrite it") from None
    except OSError:
        if os.path.lexists(path):
            raise ReceiptExistsError(f"{path} exists; pass --force to overwrite it") from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _write(text: str, path: Path, force: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())  # mkstemp's 0600 would hide the receipt from a CI runner's other users
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _link_or_replace(tmp, path, force)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sibling_path(path: Path) -> Path:
    """A free name beside `path`: `NAME.1.json`, `NAME.2.json`, ..."""
    for n in range(1, 10_000):
        candidate = path.with_name(f"{path.stem}.{n}{path.suffix}")
        if not os.path.lexists(candidate) and not os.path.lexists(str(candidate) + ".lock"):
            return candidate
    raise ReceiptError(f"no free name beside {path}")


def fallback_path(path: Path) -> Path:
    """Where a receipt goes when `path` cannot be written: the temp folder, a name not yet taken."""
    fd, name = tempfile.mkstemp(prefix="lora-parity-", suffix=f"-{path.name}")
    os.close(fd)
    return Path(name)


def write_text_atomic(text: str, path: Path, force: bool = False) -> Path:
    """Write `text` to `path` atomically (temp file, fsync, rename) and return the path written.
    Without `force` an existing file is never replaced: the run checked `path` before it started, so
    a file there now appeared during the run, and the text goes to `sibling_path(path)` instead (said
    on stderr). With `force` only a regular file is replaced. If writing fails (read-only or full file
    system, a folder in the way), the text goes to `fallback_path(path)` (said on stderr)."""
    path = Path(path)
    try:
        try:
            _write(text, path, force)
            return path
        except ReceiptExistsError:
            sibling = sibling_path(path)
            _write(text, sibling, force=False)
            print(f"lora-parity: {path} appeared during the run and was left as it is; the receipt was written "
                  f"to {sibling}", file=sys.stderr)
            return sibling
    except (ConfigError, ReceiptExistsError) as e:
        reason = str(e)
    except OSError as e:
        reason = f"{type(e).__name__}: {e.strerror or e}"
    fallback = fallback_path(path)
    try:
        _write(text, fallback, force=True)
    except OSError as e:
        fallback.unlink(missing_ok=True)
        raise ReceiptError(f"cannot write the receipt to {path} ({reason}) nor to {fallback} ({e.strerror or e})") \
            from None
    print(f"lora-parity: cannot write {path} ({reason}); the receipt was written to {fallback}", file=sys.stderr)
    return fallback
