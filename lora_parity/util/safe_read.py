"""The one way lora-parity reads a file it did not write: configs, config.json, adapter_config.json,
safetensors headers, probe files, tokenizers, keys and receipts.

A file may come from someone else (a receipt attached to a pull request, an adapter downloaded
with a model), so every read takes a regular file only, of a bounded size: a device (`/dev/zero`),
a FIFO (which would block the open or the read forever), a folder or a file over the bound is
refused with one line, before anything heavy is imported. The file is opened with O_NONBLOCK and
checked again with fstat after the open, so a FIFO swapped in after the first check cannot hang
the run either. JSON is parsed strictly: NaN and Infinity are refused.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import IO, Any

from lora_parity.util.errors import ConfigError, LoraParityError

MAX_CONFIG_BYTES = 4 * 2**20
"""A YAML config, a checkpoint's config.json or an adapter_config.json (real ones are a few KB)."""
MAX_HEADER_BYTES = 100 * 2**20
"""A safetensors header: the format's own limit."""
MAX_TOKENIZER_BYTES = 256 * 2**20
"""A checkpoint's tokenizer.json (the largest vocabularies' are tens of MB)."""

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: Path, error: type[LoraParityError] = ConfigError) -> IO[bytes]:
    """`path` opened for reading in binary, if it is a regular file (a symlink to one is fine);
    `error` (one line) otherwise. Never blocks on a FIFO."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a device is never even opened (opening some has effects)
            raise error(f"{path}: not a regular file ({_kind(mode)})")
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    f = os.fdopen(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped for something else after the stat
        f.close()
        raise error(f"{path}: not a regular file ({_kind(mode)})")
    return f


def read_bytes(path: Path, limit: int, error: type[LoraParityError] = ConfigError, what: str = "the file") -> bytes:
    """The bytes of regular file `path` of at most `limit` bytes; `error` (one line) otherwise.
    `what` names the bound in the message ("a receipt")."""
    with open_regular(path, error) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise error(f"{path}: {size} bytes is larger than {what} can be ({limit} bytes at most)")
            raw = f.read(limit + 1)  # a file that grows while it is read is still bounded
        except OSError as e:
            raise error(f"{path}: cannot read: {e.strerror or e}") from None
    if len(raw) > limit:
        raise error(f"{path}: larger than {what} can be ({limit} bytes at most)")
    return raw


def read_text(path: Path, limit: int = MAX_CONFIG_BYTES, error: type[LoraParityError] = ConfigError) -> str:
    """The UTF-8 text of regular file `path` of at most `limit` bytes (`read_bytes`)."""
    raw = read_bytes(path, limit, error)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 (byte {e.start})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def loads(text: str | bytes) -> Any:
    """JSON without NaN or Infinity (which Python's json accepts); ValueError otherwise."""
    return json.loads(text, parse_constant=_no_constant)


def read_json(path: Path, limit: int = MAX_CONFIG_BYTES, error: type[LoraParityError] = ConfigError) -> Any:
    """The JSON in regular file `path` of at most `limit` bytes, strictly parsed (`loads`)."""
    text = read_text(path, limit, error)
    try:
        return loads(text)
    except (ValueError, RecursionError) as e:
        raise error(f"{path}: not valid JSON ({str(e).splitlines()[0][:120]})") from None


def safetensors_header(path: Path, error: type[LoraParityError] = ConfigError) -> dict[str, Any]:
    """The JSON header of a safetensors file (no tensor data is read), `__metadata__` included."""
    with open_regular(path, error) as f:
        try:
            (size,) = struct.unpack("<Q", f.read(8))
        except (OSError, struct.error) as e:
            raise error(f"{path}: not a readable safetensors file ({e})") from None
        if size > MAX_HEADER_BYTES:
            raise error(f"{path}: safetensors header of {size} bytes; not a safetensors file?")
        try:
            header = loads(f.read(size))
        except (OSError, ValueError, RecursionError) as e:
            raise error(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(header, dict):
        raise error(f"{path}: not a safetensors file (its header is not an object)")
    return header
