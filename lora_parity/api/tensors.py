"""The caller's LoRA tensors as lora-parity holds them: each a shape and its values, row-major, in float64
(`Flat`), read from whatever the caller's `lora_state_dict` gives and handed back as nested lists; and the
adapter's layout read from the names (target kinds, rank, decoder layers)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lora_parity.models.perturb import is_lora_b, logical_name, target_kind
from lora_parity.util.errors import ConfigError

_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Flat:
    """One tensor: its shape and its values in row-major order."""

    shape: tuple[int, ...]
    values: tuple[float, ...]

    def nested(self) -> list[Any]:
        """The values as nested lists in `shape`."""
        return _nest(list(self.values), list(self.shape))

    def zeros(self) -> Flat:
        """A tensor of this shape, all zero."""
        return Flat(self.shape, (0.0,) * len(self.values))


def _nest(values: list[float], shape: list[int]) -> list[Any]:
    if len(shape) <= 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_nest(values[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _flatten(value: Any, name: str) -> tuple[list[int], list[float]]:
    """(shape, values) of nested sequences of numbers; `ConfigError` for a ragged or non-numeric one."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [], [float(value)]
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"tensor {name}: not a non-empty nested list of numbers (or an array with .tolist())")
    parts = [_flatten(v, name) for v in value]
    if any(shape != parts[0][0] for shape, _ in parts):
        raise ConfigError(f"tensor {name}: ragged (its rows differ in shape)")
    return [len(parts), *parts[0][0]], [x for _, values in parts for x in values]


def to_flat(name: str, value: Any) -> Flat:
    """One tensor the caller gave: nested lists, or anything with `.tolist()` (numpy, a CPU torch tensor)."""
    raw = value.tolist() if hasattr(value, "tolist") else value
    shape, values = _flatten(raw, name)
    if not all(math.isfinite(x) for x in values):
        raise ConfigError(f"tensor {name}: holds a non-finite value")
    return Flat(tuple(shape), tuple(values))


def read_state(state: Mapping[str, Any], who: str) -> dict[str, Flat]:
    """The tensors of a `lora_state_dict()` (`who` names its owner in errors)."""
    if not isinstance(state, Mapping) or not state:
        raise ConfigError(f"{who}.lora_state_dict() returned no tensors (a mapping of name -> tensor is needed)")
    return {str(name): to_flat(str(name), value) for name, value in state.items()}


def nested_state(state: Mapping[str, Flat]) -> dict[str, list[Any]]:
    """What the caller's `load_lora_state_dict` is handed: every tensor as nested lists of floats."""
    return {name: flat.nested() for name, flat in state.items()}


def partner(name: str) -> str:
    """The other half of a LoRA pair: lora_A's lora_B and the reverse."""
    return name.replace(".lora_A", ".lora_X").replace(".lora_B", ".lora_A").replace(".lora_X", ".lora_B")


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to: the first all-digit part of its logical name (None: none)."""
    found = _LAYER.search(logical_name(name))
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Layout:
    """What the names and shapes of the trainer's LoRA tensors say about its adapter."""

    targets: list[str]
    """Target kinds, in the order they first appear."""
    rank: int
    layers: list[int]
    """Decoder layers that hold LoRA tensors, ascending; empty where some tensor names none."""


def layout(state: Mapping[str, Flat]) -> Layout:
    """The adapter's layout; `ConfigError` for a name that is not a LoRA tensor's, a tensor without its pair,
    a tensor that is not 2-D, or ranks that differ."""
    targets: list[str] = []
    ranks: set[int] = set()
    for name, flat in state.items():
        try:
            kind = target_kind(name)
        except ValueError:
            raise ConfigError(f"tensor {name}: not a LoRA tensor's name (lora_A or lora_B after the module's "
                              "name)") from None
        if partner(name) not in state:
            raise ConfigError(f"tensor {name} has no partner {partner(name)}")
        if len(flat.shape) != 2:
            raise ConfigError(f"tensor {name}: shape {list(flat.shape)}; LoRA A is [rank, in] and B [out, rank]")
        ranks.add(flat.shape[1] if is_lora_b(name) else flat.shape[0])
        if kind not in targets:
            targets.append(kind)
    if len(ranks) != 1:
        raise ConfigError(f"the LoRA tensors have ranks {sorted(ranks)}; one rank is needed")
    found = [layer_of(name) for name in state]
    layers = sorted({x for x in found if x is not None}) if None not in found else []
    return Layout(targets, ranks.pop(), layers)
