"""PEFT LoRA layers that add exactly zero, left out of a scoring forward (issue 47).

A vanilla LoRA linear layer adds `lora_B(lora_A(x)) * scaling` to its base output. Where every B parameter of the
layer (weight and bias) is exactly zero, that term is exactly zero, and adding it changes no value: the layer's
output is its base output, bit for bit. At zero-init every layer is so, and during per-target coverage all but one
target kind's; of each LoRA layer's three matmuls (base, A, B) two are its adapter's, and on a GPU a small model's
forward costs its launches. `skipped` turns such layers' adapters off for one forward and back on after it.

What is checked is the tensors' values now, in one host sync, never a belief about them (a fault that writes a B
is seen). Not skipped: merged layers, a variant (DoRA: its magnitude rescales even at B = 0), other layer types
(embeddings, MoE experts), and any B holding a non-zero, an infinity or a NaN. The one difference a skip can make is
where the term is not zero after all: an infinite activation times a zero B (NaN), which only a model already
overflowing in its base path meets.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from peft.tuners.lora.layer import Linear as LoraLinear

_LAYERS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
"""Each model's LoRA linear layers, found once (a walk of every module per forward costs)."""


def lora_linears(model: Any) -> list[Any]:
    """The model's PEFT LoRA linear layers, in module order."""
    layers = _LAYERS.get(model)
    if layers is None:
        layers = _LAYERS[model] = [m for m in model.modules() if type(m) is LoraLinear]
    return layers


def _b_parameters(layer: Any) -> list[torch.Tensor] | None:
    """The B parameters of the layer's active adapters; None where the layer cannot be skipped whatever they hold."""
    if layer.disable_adapters or layer.merged:
        return None
    params: list[torch.Tensor] = []
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if name in layer.lora_variant:
            return None
        params += list(layer.lora_B[name].parameters())
    return params or None


def zero_layers(model: Any) -> list[Any]:
    """The model's LoRA linear layers whose every active B parameter is exactly zero now (one host sync)."""
    candidates = [(layer, params) for layer in lora_linears(model) if (params := _b_parameters(layer)) is not None]
    if not candidates:
        return []
    # each tensor's max |x| (one fused kernel on a GPU): zero exactly when every element is (no squares to
    # underflow, a subnormal stays non-zero; a NaN is not zero)
    norms = torch._foreach_norm([p.detach() for _, params in candidates for p in params], float("inf"))
    if len({n.device for n in norms}) == 1:
        nonzero = torch.stack(list(norms)).ne(0).tolist()
    else:  # a model spread over devices
        nonzero = [bool(n.ne(0)) for n in norms]
    out, at = [], 0
    for layer, params in candidates:
        if not any(nonzero[at:at + len(params)]):
            out.append(layer)
        at += len(params)
    return out


@contextlib.contextmanager
def skipped(model: Any, layers: list[Any] | None = None) -> Iterator[int]:
    """Within: the layers of `zero_layers` (or `layers`, found by it just before) run their base layer alone;
    yields how many."""
    layers = zero_layers(model) if layers is None else layers
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer._disable_adapters = False
