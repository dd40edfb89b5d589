"""A trainer's update restricted to some of its decoder layers, for per-layer coverage (`Run.layer_coverage`):
within `restricted`, the trainer's perturbation (and its calibration) touches only the LoRA tensors of those
layers, so an engine that drops one layer's update shows it as a large part of the phase's change."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

LAYER = re.compile(r"\.layers\.(\d+)\.")
"""A decoder layer's index in a parameter's name (HF and PEFT: `model.layers.N.`)."""


def layer_of(name: str) -> int | None:
    """The decoder layer a parameter belongs to, or None."""
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


def layer_indices(names: Iterable[str]) -> list[int]:
    """Every decoder layer index among `names`, ascending."""
    return sorted({i for n in names if (i := layer_of(n)) is not None})


def keeps(layers: frozenset[int] | None, name: str) -> bool:
    """Whether a parameter is in the restriction (every parameter where there is none)."""
    return layers is None or layer_of(name) in layers


@contextmanager
def restricted(trainer: Any, layers: Collection[int]) -> Iterator[None]:
    """Within: `trainer.layers_only` is `layers` (the trainer's perturbation reads it); afterwards as before."""
    before = trainer.layers_only
    trainer.layers_only = frozenset(layers)
    try:
        yield
    finally:
        trainer.layers_only = before
