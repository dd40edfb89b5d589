"""The adapter file the sync handed the engine, read by lora-parity itself, against the trainer's tensors in memory
(issue 50, "the side"): where the file holds exactly the trainer's adapter (up to the rounding to the file's
dtype), a wrong reading of a right file is the engine's; where it does not, the export is wrong."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lora_parity.evidence.receipt import NOTHING_COMPARED
from lora_parity.models import adapter_files as af
from lora_parity.models.fresh_adapter import RawTensor

SIGNIFICANT_BITS = {"BF16": 8, "F16": 11, "F32": 24, "F64": 53}
"""A value cast to a dtype moves by at most half its spacing there: 2**-bits of itself (or a subnormal's step)."""
SHOWN = 3
NOTHING = NOTHING_COMPARED
"""What `differences` says where the trainer handed no tensors (and then nothing about the file's tensors)."""


def differences(folder: Path, trainer: Mapping[str, RawTensor], rank: int, alpha: float) -> list[str]:
    """What differs between the PEFT folder and the trainer's tensors and spec, beyond the rounding to the file's
    dtype; empty where the file holds exactly the trainer's adapter."""
    config, tensors = af.read_adapter(folder)
    out = []
    if config.get("r") != rank:
        out.append(f"r is {config.get('r')!r}, the trainer's {rank}")
    if not isinstance(config.get("lora_alpha"), (int, float)) or float(config["lora_alpha"]) != float(alpha):
        out.append(f"lora_alpha is {config.get('lora_alpha')!r}, the trainer's {alpha:g}")
    if config.get("use_rslora"):
        out.append("use_rslora is on (alpha/sqrt(r)); the trainer scales by alpha/r")
    if not trainer:  # a comparison over nothing proves nothing (a checksum dropped on the way reads as "verified")
        return [*out, NOTHING]  # the file's tensors are not "not the trainer's": there was nothing to hold them to
    missing, extra = sorted(set(trainer) - set(tensors)), sorted(set(tensors) - set(trainer))
    other = [n for n in sorted(set(trainer) & set(tensors)) if not _same(tensors[n], trainer[n])]
    for names, what in ((missing, "missing"), (extra, "not the trainer's"), (other, "with other values")):
        if names:
            out.append(f"{len(names)} tensors {what}: {where(names)}")
    return out


def where(names: list[str]) -> str:
    """Tensor names as the layers and modules they belong to: "layers 1, 3; modules down_proj (lora_B)"."""
    layers = sorted({int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))})
    modules = sorted({m.group(1) for n in names if (m := re.search(r"\.([A-Za-z0-9_]+)\.lora_[AB]", n))})
    sides = sorted({m.group(1) for n in names if (m := re.search(r"\.(lora_[AB])\b", n))})
    parts = []
    if layers:
        parts.append(f"layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}")
    if modules:
        parts.append(f"modules {', '.join(modules)}" + (f" ({', '.join(sides)})" if sides else ""))
    more = ", ..." if len(names) > SHOWN else ""
    return "; ".join(parts) if parts else f"{', '.join(names[:SHOWN])}{more}"


def _ranges(values: list[int]) -> str:
    """1, 3-5, 9: consecutive runs joined."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _same(file: af.Tensor, raw: RawTensor) -> bool:
    dtype, shape, data = raw
    if list(file.shape) != list(shape):
        return False
    if file.dtype == dtype:
        return file.data == data
    import numpy as np

    a, b = _values(file.dtype, file.data), _values(dtype, data)
    bits = SIGNIFICANT_BITS[file.dtype]
    tiny = 2.0 ** -(bits + 14 if file.dtype == "F16" else 126)
    return bool(np.all(np.abs(a - b) <= np.abs(b) * 2.0 ** -bits + tiny))


def _values(dtype: str, data: bytes) -> Any:
    import numpy as np

    if dtype == "BF16":
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    kind = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}[dtype]
    return np.frombuffer(data, dtype=kind).astype(np.float64)
