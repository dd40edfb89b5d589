"""The trainer's current LoRA tensors as a PEFT folder, written by a writer of its own (the exact sync
check, X in docs/verdicts.md). It shares no code with the exporters (`adapter_files.write_adapter`,
PEFT's `save_pretrained`, a trainer's own export): a sync that drops, casts, rescales or keeps old
tensors shows up as a difference between what the sync published and this folder, loaded fresh.

A tensor is given as (safetensors dtype, shape, little-endian bytes), in PEFT's saved names
(`base_model.model.<module path>.lora_A.weight`).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

RawTensor = tuple[str, list[int], bytes]
"""(dtype, shape, bytes) of one tensor."""

ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def write(folder: Path, tensors: Mapping[str, RawTensor], rank: int, alpha: float, targets: Sequence[str],
          target_parameters: Sequence[str] = ()) -> Path:
    """Write `adapter_model.safetensors` and `adapter_config.json` for `tensors` into the new folder
    `folder` (rank `rank`, lora_alpha `alpha`, on `targets`, and on the expert parameters `target_parameters`
    where given: without them PEFT would not load the expert tensors); return it."""
    header: dict[str, object] = {}
    offset = 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        if len(data) != ITEM_SIZES[dtype] * math.prod(shape):
            raise ValueError(f"{name}: {len(data)} bytes for a {dtype} tensor of shape {shape}")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    folder.mkdir(parents=True)
    with open(folder / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in sorted(tensors):
            f.write(tensors[name][2])
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "modules_to_save": None, "base_model_name_or_path": None,
              "inference_mode": True}
    if target_parameters:
        config["target_parameters"] = list(target_parameters)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder
