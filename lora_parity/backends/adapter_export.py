"""The HF trainer's adapter folder, byte for byte what PEFT's `save_pretrained` writes, at a fraction of its cost
(issue 47): an adapter is exported at every sync and per-target point (nine times in a default run).

The first export of a model is PEFT's own save (without its README.md model card, which no engine reads), given
the LoRA tensors on the host in one copy. Each later one writes the same two files itself: `adapter_model.safetensors`
from the LoRA tensors under PEFT's saved names (the adapter name left out), with PEFT's metadata, and
`adapter_config.json` as the first save wrote it (the config does not change between versions). PEFT walked the
whole model's modules several times per save; on a GPU it also copied each tensor to the host on its own. Where the
tensors PEFT saved are not exactly those the names give (another adapter type), every export stays PEFT's.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lora_parity.backends.raw_tensors import DTYPES, to_host_all
from lora_parity.util import safe_read

ADAPTER_NAME = "default"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def saved_name(name: str) -> str:
    """PEFT's saved name of a LoRA parameter: its name with the adapter's left out."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def write_safetensors(path: Path, named: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bool:
    """Write `named` as safetensors' `save_file` does, byte for byte, from one host copy of all the values (False,
    nothing written, where this does not apply: tensors of several dtypes or devices, a name outside printable ASCII
    or holding a quote or backslash, a big-endian host). `save_file` orders the data by dtype, then by name, lists the
    header's tensors in that order after `__metadata__`, in compact JSON padded with spaces to a multiple of 8 bytes;
    the copies it was given were one host tensor each (about half an export's time: issue 47)."""
    items = sorted(named, key=lambda item: item[0])
    dtypes = {t.dtype for _, t in items}
    plain = all(name.isascii() and name.isprintable() and '"' not in name and "\\" not in name for name, _ in items)
    one = len(dtypes) == 1 and len({t.device for _, t in items}) == 1
    if not one or next(iter(dtypes)) not in DTYPES or not plain or sys.byteorder != "little":
        return False
    flat = torch.cat([t.detach().reshape(-1) for _, t in items]).to("cpu")
    header: dict[str, Any] = {"__metadata__": metadata}
    at, size = 0, flat.element_size()
    for name, t in items:
        end = at + t.numel() * size
        header[name], at = {"dtype": DTYPES[flat.dtype], "shape": list(t.shape), "data_offsets": [at, end]}, end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        out.write(flat.view(torch.uint8).numpy().data)
    return True


class AdapterWriter:
    """Exports one PEFT model's adapter (`write`); keeps the first save's config file for the later ones."""

    def __init__(self) -> None:
        self._config: bytes | None = None
        self._direct = False

    def write(self, model: Any, named: Sequence[tuple[str, torch.nn.Parameter]], directory: Path) -> Path:
        """Write the adapter of PEFT model `model` (its parameters `named`) to `directory`, created here."""
        from safetensors.torch import save_file

        lora = [(n, p) for n, p in named if "lora_" in n]
        if self._config is not None and self._direct:
            directory.mkdir(parents=True, exist_ok=True)
            renamed = [(saved_name(n), p) for n, p in lora]
            if not write_safetensors(directory / WEIGHTS, renamed, {"format": "pt"}):
                save_file(to_host_all(renamed), str(directory / WEIGHTS), metadata={"format": "pt"})
            (directory / CONFIG).write_bytes(self._config)
            return directory
        model.create_or_update_model_card = lambda output_dir: None  # shadows PEFT's method: no README.md
        model.save_pretrained(str(directory), safe_serialization=True, state_dict=to_host_all(lora))
        if self._config is None:  # PEFT's files, read back bounded as any
            self._config = safe_read.read_bytes(directory / CONFIG, safe_read.MAX_CONFIG_BYTES)
            saved = set(safe_read.safetensors_header(directory / WEIGHTS)) - {"__metadata__"}
            self._direct = saved == {saved_name(n) for n, _ in lora}
        return directory
