"""The file faults of an exported update (`UPDATE_FILE_FAULTS`; their specs are in `lora_parity.run.faults`):
how each rewrites the tensors the trainer wrote, from them and the previous version's, before the sampler
loads them (`Faults.after_export` calls `rewrite_update`).
"""

from __future__ import annotations

import math
import re

from lora_parity.models import adapter_files as af
from lora_parity.models.perturb import is_lora_b

UPDATE_FILE_FAULTS = ("stale-a", "partial-export", "fp16-export", "up-gets-gate")
"""File faults of an exported update (`rewrite_update`)."""


def rewrite_update(fault: str, version: int, tensors: dict[str, af.Tensor],
                   previous: dict[str, af.Tensor] | None) -> dict[str, af.Tensor]:
    """The exported update's tensors as `fault` (one of `UPDATE_FILE_FAULTS`) rewrites them; `previous`: the
    last version's."""
    if previous is not None and fault == "stale-a":
        return {n: previous.get(n, t) if not is_lora_b(n) else t for n, t in tensors.items()}
    if previous is not None and fault == "partial-export":
        layers = sorted(i for i in {_layer(n) for n in tensors} if i is not None)
        kept = set(layers[len(layers) // 2:])
        return {n: previous.get(n, t) if _layer(n) in kept else t for n, t in tensors.items()}
    if fault == "fp16-export":
        return {n: _fp16(t) for n, t in tensors.items()}
    if version > 0 and fault == "up-gets-gate":
        return {n: tensors.get(n.replace(".up_proj.", ".gate_proj."), t) if ".up_proj." in n else t
                for n, t in tensors.items()}
    return tensors


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _layer(name: str) -> int | None:
    """The decoder layer index in a tensor's name, or None."""
    found = _LAYER.search(name)
    return int(found.group(1)) if found else None


FP16_MAX = 65504.0
"""The largest finite fp16; a value that rounds beyond it is inf, as torch's `.half()` makes it."""


def _fp16(t: af.Tensor) -> af.Tensor:
    """`t` cast to fp16 and stored as F16 (the sampler casts it to its own dtype when it loads)."""
    values = [math.copysign(math.inf, v) if abs(v) >= FP16_MAX + 16 else v for v in t.to_floats()]
    return af.Tensor.from_floats("F16", t.shape, values)
