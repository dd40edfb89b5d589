"""The adapter file the sync handed the engine, read by lora-parity itself, against the trainer's tensors in memory
(issue 50, "the side"): where the file holds exactly the trainer's adapter (up to the rounding to the file's
dtype), a wrong reading of a right file is the engine's; where it does not, the export is wrong."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lora_parity.evidence.receipt import NOTHING_COMPARED
from lora_parity.models import adapter_files as af
from lora_parity.models.adapter_spec import EXPERT_KINDS
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.models.perturb import target_kind

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
    experts = sorted({e for n in other if _kind(n) in EXPERT_KINDS
                      for e in _experts_apart(n, tensors[n], trainer[n], rank)})
    for names, what in ((missing, "missing"), (extra, "not the trainer's"), (other, "with other values")):
        if names:
            out.append(f"{len(names)} tensors {what}: {where(names, experts if names is other else ())}")
    return out


def where(names: list[str], experts: Sequence[int] = ()) -> str:
    """Tensor names as the layers and modules they belong to: "layers 1, 3; modules down_proj (lora_B)"; with the
    routed experts whose slices differ (`experts`): "...; modules experts.down_proj, experts.gate_up_proj (lora_B),
    expert 3"."""
    layers = sorted({int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))})
    modules = sorted({k for n in names if (k := _kind(n)) is not None})
    sides = sorted({m.group(1) for n in names if (m := re.search(r"\.(lora_[AB])\b", n))})
    parts = []
    if layers:
        parts.append(f"layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}")
    if modules:
        parts.append(f"modules {', '.join(modules)}" + (f" ({', '.join(sides)})" if sides else ""))
    if experts:
        parts.append(f"expert{'s' if len(experts) > 1 else ''} {_ranges(list(experts))}")
    more = ", ..." if len(names) > SHOWN else ""
    return "; ".join(parts) if parts else f"{', '.join(names[:SHOWN])}{more}"


def _kind(name: str) -> str | None:
    """The target kind of a LoRA tensor's name (`perturb.target_kind`: a routed-expert wrapper by the parameter it
    wraps), or None for another name."""
    if not re.search(r"\.[A-Za-z0-9_]+\.lora_[AB]\b", name):
        return None
    try:
        return target_kind(name)
    except ValueError:
        return None


def _experts_apart(name: str, file: af.Tensor, raw: RawTensor, rank: int) -> list[int]:
    """The routed experts whose slice of fused expert tensor `name` differs between the file and the trainer
    beyond the rounding to the file's dtype: B [out, E*r] holds expert e's columns `e::E` (PEFT's `ParamWrapper`:
    `B.reshape(out, r, E)[:, :, e]`), A [E*r, in] its rows `e*r:(e+1)*r`. Empty where the shapes differ."""
    import numpy as np

    shape = raw[1]
    if list(file.shape) != list(shape) or len(shape) != 2 or shape[0 if ".lora_A" in name else 1] % rank:
        return []
    apart = ~_within_rounding(file, raw).reshape(shape)
    if ".lora_A" in name:
        return sorted({int(i) // rank for i in np.flatnonzero(apart.any(axis=1))})
    experts = shape[1] // rank
    return sorted({int(j) % experts for j in np.flatnonzero(apart.any(axis=0))})


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
    return bool(_within_rounding(file, raw).all())


def _within_rounding(file: af.Tensor, raw: RawTensor) -> Any:
    """Per element (flat): the file's value is the trainer's, at most rounded to the file's dtype."""
    import numpy as np

    dtype, _, data = raw
    a, b = _values(file.dtype, file.data), _values(dtype, data)
    if file.dtype == dtype:
        return a == b
    bits = SIGNIFICANT_BITS[file.dtype]
    tiny = 2.0 ** -(bits + 14 if file.dtype == "F16" else 126)
    return np.abs(a - b) <= np.abs(b) * 2.0 ** -bits + tiny


def _values(dtype: str, data: bytes) -> Any:
    import numpy as np

    if dtype == "BF16":
        return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    kind = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}[dtype]
    return np.frombuffer(data, dtype=kind).astype(np.float64)
