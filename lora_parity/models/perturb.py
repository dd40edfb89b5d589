"""Deterministic, fixed-magnitude perturbation of LoRA B tensors: which tensors, and their seeds."""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

_ADAPTER_NAME = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")
_PEFT_PREFIX = "base_model.model."


def logical_name(param_name: str) -> str:
    """A LoRA parameter's name without the PEFT wrapper prefix and adapter name:
    'base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight' ->
    'model.layers.0.self_attn.q_proj.lora_B'. Backends with other naming map to the same form."""
    name = param_name.removeprefix(_PEFT_PREFIX)
    name = _ADAPTER_NAME.sub(r".lora_\1", name)
    return name.removesuffix(".weight")


def is_lora_b(param_name: str) -> bool:
    """True for a LoRA B ("up" / `linear_out`) parameter."""
    return ".lora_B" in param_name or ".adapter.linear_out" in param_name


EXPERT_WRAPPERS = {"experts.base_layer": "experts.gate_up_proj", "experts": "experts.down_proj"}
"""PEFT's wrappers of the fused expert parameters (`adapter_spec.EXPERT_PARAMETERS`, both targeted: PEFT wraps
gate_up_proj inside down_proj) -> their target kinds."""


def target_kind(param_name: str) -> str:
    """The target module a LoRA parameter belongs to: the path component before lora_A/lora_B; the routed
    experts' `experts.base_layer` and `experts` (`EXPERT_WRAPPERS`) read `experts.gate_up_proj` and
    `experts.down_proj`."""
    parts = logical_name(param_name).split(".")
    for i, part in enumerate(parts):
        if part in ("lora_A", "lora_B", "adapter") and i > 0:
            wrapper = ".".join(parts[max(0, i - 2):i])
            if wrapper in EXPERT_WRAPPERS:
                return EXPERT_WRAPPERS[wrapper]
            return EXPERT_WRAPPERS.get(parts[i - 1], parts[i - 1])
    raise ValueError(f"{param_name} is not a LoRA parameter")


RECIPE = ("for each tensor in `tensors` (B = lora_B / linear_out): seed = int.from_bytes(sha256(f'{seed}:{name}')"
          "[:8], 'little') & (2**63 - 1), name the logical name (PEFT prefix and adapter name removed); "
          "B += torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=float32) * std, cast to "
          "B's dtype; B starts at zero or at the start adapter's B")
"""The recipe of kind lora_b_noise, recorded in every receipt (`Perturbation.recipe`): the update rebuilt
from the receipt alone."""


PYTHON_RECIPE = ("for each tensor in `tensors` (B = lora_B): seed as in torch's recipe (int.from_bytes(sha256("
                 "f'{seed}:{name}')[:8], 'little') & (2**63 - 1), name the logical name); rng = random.Random(seed); "
                 "B[i] += rng.gauss(0.0, std) for each element i in row-major order, in float64; B starts at zero")
"""The recipe of kind lora_b_noise drawn with Python's own generator (`python_noise`: the Python API, which
needs no torch)."""


def python_noise(name: str, seed: int, std: float, num_elements: int) -> list[float]:
    """`num_elements` values of N(0, std²) for tensor `name`, row-major, by `PYTHON_RECIPE`."""
    rng = random.Random(noise_seed(name, seed))
    return [rng.gauss(0.0, std) for _ in range(num_elements)]


def noise_seed(name: str, seed: int) -> int:
    """63-bit seed of one tensor's noise: sha256 of its logical name and the run seed."""
    digest = hashlib.sha256(f"{seed}:{logical_name(name)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class UnitNoise:
    """Each tensor's N(0, 1) draw for one seed (`torch.randn` of a generator seeded with `noise_seed`), drawn once
    and kept: a calibration's search perturbs the same tensors with the same seed at every std it tries, and the
    draws were most of each perturb's time (issue 47). `scaled` is the draw times std, the very values of a fresh
    draw times std. Only the latest seed's draws are kept."""

    def __init__(self) -> None:
        self.seed: int | None = None
        self.draws: dict[str, Tensor] = {}

    def scaled(self, name: str, shape: Sequence[int], seed: int, std: float) -> Tensor:
        import torch

        if seed != self.seed:
            self.seed, self.draws = seed, {}
        if name not in self.draws:
            generator = torch.Generator().manual_seed(noise_seed(name, seed))
            self.draws[name] = torch.randn(list(shape), generator=generator, dtype=torch.float32)
        return self.draws[name] * std


def add_noise(pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
    """Add each (host) noise tensor to its tensor in place, with one copy per device and dtype rather than one
    per tensor: on a GPU shared with other processes every copy waits its turn."""
    import torch

    groups: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, Tensor]]] = {}
    for target, noise in pairs:
        groups.setdefault((target.device, target.dtype), []).append((target, noise))
    for (device, dtype), group in groups.items():
        flat = torch.cat([noise.reshape(-1) for _, noise in group]).to(device=device, dtype=dtype)
        parts = flat.split([noise.numel() for _, noise in group])
        torch._foreach_add_([target for target, _ in group],  # one fused call, not one per tensor (issue 47)
                            [part.view(noise.shape) for (_, noise), part in zip(group, parts, strict=True)])

