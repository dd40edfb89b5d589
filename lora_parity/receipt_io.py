"""Reading and writing receipt files safely: bytes and JSON only, no receipt models (see receipt.py).

Reading takes only regular files, with a size bound checked before and while reading, so `/dev/zero`,
a FIFO or a huge file is refused at once. JSON is parsed strictly: duplicate keys, NaN/Infinity and
numbers that overflow to infinity are refused with a one-line message that names the field.
Writing is atomic, and a receipt that cannot be written where asked goes to a fallback path,
which is printed.
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

from lora_parity.errors import ReceiptError, ReceiptExistsError

MAX_RECEIPT_BYTES = 64 * 1024 * 1024
"""Largest receipt file `verify` reads. Real receipts are 100-140 KB (the largest committed one,
GPU runs included, is 133 KB); 64 MiB leaves a margin of about 500x and reads in seconds."""


def read_bounded(path: Path, limit: int = MAX_RECEIPT_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; `ReceiptError` (one line) otherwise."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ReceiptError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise ReceiptError(f"{path}: {st.st_size} bytes is larger than a receipt can be ({limit} bytes at most)")
        # O_NONBLOCK: a FIFO swapped in after the stat must not block the open.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ReceiptError(f"{path}: not a regular file")
            raw = f.read(limit + 1)
    except OSError as e:
        raise ReceiptError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) > limit:
        raise ReceiptError(f"{path}: larger than a receipt can be ({limit} bytes at most)")
    return raw


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


def _write(text: str, path: Path, force: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if not force and path.exists():
            raise ReceiptExistsError(f"{path} exists; pass --force to overwrite it")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fallback_path(path: Path) -> Path:
    """Where a receipt goes when `path` cannot be written: the temp folder, a name not yet taken."""
    fd, name = tempfile.mkstemp(prefix="lora-parity-", suffix=f"-{path.name}")
    os.close(fd)
    return Path(name)


def write_text_atomic(text: str, path: Path, force: bool = False) -> Path:
    """Write `text` to `path` atomically (temp file, fsync, rename); refuse to overwrite an existing
    file unless `force`. If writing fails (read-only or full file system, a folder in the way), write
    to `fallback_path(path)` instead, say so on stderr, and return the path written."""
    path = Path(path)
    if path.exists() and not force:
        raise ReceiptExistsError(f"{path} exists; pass --force to overwrite it")
    try:
        _write(text, path, force)
        return path
    except ReceiptExistsError:
        raise
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
