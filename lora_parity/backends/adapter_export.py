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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lora_parity.backends.raw_tensors import to_host_all
from lora_parity.util import safe_read

ADAPTER_NAME = "default"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def saved_name(name: str) -> str:
    """PEFT's saved name of a LoRA parameter: its name with the adapter's left out."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


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
            state = to_host_all((saved_name(n), p) for n, p in lora)
            save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})
            (directory / CONFIG).write_bytes(self._config)
            return directory
        model.create_or_update_model_card = lambda output_dir: None  # shadows PEFT's method: no README.md
        model.save_pretrained(str(directory), safe_serialization=True, state_dict=to_host_all(lora))
        if self._config is None:  # PEFT's files, read back bounded as any
            self._config = safe_read.read_bytes(directory / CONFIG, safe_read.MAX_CONFIG_BYTES)
            saved = set(safe_read.safetensors_header(directory / WEIGHTS)) - {"__metadata__"}
            self._direct = saved == {saved_name(n) for n, _ in lora}
        return directory
