"""PEFT adapter folders (adapter_config.json + adapter_model.safetensors), read and written in plain Python.

The safetensors format is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes. Working on it directly lets the fake
backends and the fault injections handle the same files the real backends write, in any float
dtype, without torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


@dataclass
class Tensor:
    """One tensor's dtype, shape and raw little-endian bytes."""

    dtype: str
    shape: list[int]
    data: bytes

    def to_floats(self) -> list[float]:
        """Element values as Python floats (row-major)."""
        n = len(self.data) // _SIZES[self.dtype]
        if self.dtype == "F32":
            return list(struct.unpack(f"<{n}f", self.data))
        if self.dtype == "F64":
            return list(struct.unpack(f"<{n}d", self.data))
        if self.dtype == "F16":
            return list(struct.unpack(f"<{n}e", self.data))
        # bf16 is the top half of an fp32.
        return [struct.unpack("<f", b"\x00\x00" + self.data[2 * i : 2 * i + 2])[0] for i in range(n)]

    @classmethod
    def from_floats(cls, dtype: str, shape: list[int], values: list[float]) -> Tensor:
        """A tensor of `dtype` holding `values` (bf16 by truncation of the fp32 bits)."""
        if dtype == "F32":
            data = struct.pack(f"<{len(values)}f", *values)
        elif dtype == "F64":
            data = struct.pack(f"<{len(values)}d", *values)
        elif dtype == "F16":
            data = struct.pack(f"<{len(values)}e", *values)
        elif dtype == "BF16":
            data = b"".join(struct.pack("<f", v)[2:] for v in values)
        else:
            raise ConfigError(f"unsupported tensor dtype {dtype}")
        return cls(dtype, shape, data)


def read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors by name, and the file's metadata."""
    with safe_read.open_regular(Path(path)) as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {}) or {}
    body = raw[8 + n :]
    tensors = {}
    for name, h in header.items():
        start, end = h["data_offsets"]
        if h["dtype"] not in _SIZES:
            raise ConfigError(f"{path}: unsupported tensor dtype {h['dtype']} for {name}")
        tensors[name] = Tensor(h["dtype"], list(h["shape"]), body[start:end])
    return tensors, meta


def write_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write tensors in safetensors format, names sorted, header padded to 8 bytes."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in sorted(tensors):
            f.write(tensors[name].data)


def read_config(folder: Path) -> dict[str, Any]:
    """The adapter's adapter_config.json."""
    config: dict[str, Any] = safe_read.read_json(Path(folder) / CONFIG_FILE)
    return config


def write_config(folder: Path, config: dict[str, Any]) -> None:
    """Write adapter_config.json."""
    (Path(folder) / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(adapter_config, tensors) of a PEFT adapter folder."""
    tensors, _ = read_safetensors(Path(folder) / WEIGHTS_FILE)
    return read_config(folder), tensors


def write_adapter(folder: Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """Write a PEFT adapter folder (creating it)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    write_config(folder, config)
    write_safetensors(Path(folder) / WEIGHTS_FILE, tensors, {"format": "pt"})


def negate(t: Tensor) -> Tensor:
    """The same tensor with every element's sign flipped (the sign bit, in any float dtype)."""
    size = _SIZES[t.dtype]
    data = bytearray(t.data)
    for i in range(size - 1, len(data), size):
        data[i] ^= 0x80
    return Tensor(t.dtype, t.shape, bytes(data))
