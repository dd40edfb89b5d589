"""The two roles. A trainer owns the LoRA adapter being trained; a sampler serves published versions of it.

Token alignment, for every `score` below: for a sequence of n token ids it returns n - 1 values,
and entry t is log p(tokens[t+1] | tokens[:t+1]), computed in fp32 from the model's logits.
There is no value for the first token. Each sequence is scored on its own (one sequence per
forward or request), because batching changes numbers on real backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lora_parity.receipt import BackendInfo, Perturbation

Sequences = list[list[int]]
Scores = list[list[float]]


@dataclass(frozen=True)
class AdapterHandle:
    """An adapter version the sampler has loaded."""

    name: str
    adapter_id: int
    path: Path


class Trainer(Protocol):
    """The side that updates the adapter."""

    def score(self, sequences: Sequences) -> Scores:
        """Logprobs of the current model (base + adapter); len(s) - 1 values per sequence, entry t
        = log p(s[t+1] | s[:t+1])."""
        ...

    def perturb(self, std: float, seed: int, only: str | None = None) -> Perturbation:
        """Add seeded Gaussian noise N(0, std²) to every LoRA B tensor (or only those of target
        kind `only`), each seeded by sha256 of its logical name and `seed`; no optimizer. Refuses
        if a B tensor is non-zero before, or a non-adapter parameter is trainable."""
        ...

    def zero_b(self) -> None:
        """Set every LoRA B tensor back to zero (A unchanged)."""
        ...

    def export_adapter(self, directory: Path) -> Path:
        """Write the adapter in PEFT format (adapter_config.json + adapter_model.safetensors) into a
        new folder `directory`; return it."""
        ...

    def info(self) -> BackendInfo:
        """Backend name, package versions and the settings that change numbers."""
        ...

    def close(self) -> None:
        """Free the model."""
        ...


class Sampler(Protocol):
    """The side that serves published adapter versions."""

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        """Prompt logprobs of each sequence under `adapter` (None: the base model); len(s) - 1
        values per sequence, entry t = log p(s[t+1] | s[:t+1]) (the engine's entry t + 1)."""
        ...

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        """Load the PEFT adapter in `directory` under `name` and `adapter_id`. With `inplace`, an
        adapter already loaded under that id is replaced; without it, the engine may keep
        serving what it has under that id (the real engines do)."""
        ...

    def retire(self, handle: AdapterHandle) -> None:
        """Unload an adapter version and drop cached state (prefix cache)."""
        ...

    def info(self) -> BackendInfo:
        """Backend name, package versions and the settings that change numbers."""
        ...

    def close(self) -> None:
        """Shut the engine down."""
        ...
