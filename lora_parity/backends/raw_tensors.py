"""A torch tensor as (safetensors dtype, shape, little-endian bytes): what a `TensorReadingTrainer`
gives the exact sync check (`models.fresh_adapter`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.util.errors import ConfigError

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


def _on_host(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[tuple[list[tuple[str, torch.Tensor]],
                                                                                 torch.Tensor]]]:
    """The names in order, and each (device, dtype) group of the tensors with all its values copied to the host in one
    transfer (flattened in the group's order): one transfer per tensor made a GPU wait once per tensor, hundreds of
    waits for an adapter's LoRA tensors (issue 47)."""
    items = [(name, t.detach()) for name, t in named]
    kinds: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, t in items:
        kinds.setdefault((t.device, t.dtype), []).append((name, t))
    return [n for n, _ in items], [(g, torch.cat([t.reshape(-1) for _, t in g]).to("cpu")) for g in kinds.values()]


def to_host_all(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each tensor copied to the host (a tensor of its own, same dtype and shape), as `to_raw_all`."""
    names, groups = _on_host(named)
    out: dict[str, torch.Tensor] = {}
    for group, flat in groups:
        for (name, t), part in zip(group, flat.split([t.numel() for _, t in group]), strict=True):
            out[name] = part.view(t.shape).clone()
    return {name: out[name] for name in names}


def to_raw_all(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, RawTensor]:
    """Each tensor's values as they are (no cast), copied to the host in one transfer per device and dtype."""
    names, groups = _on_host(named)
    out: dict[str, RawTensor] = {}
    for group, flat in groups:
        data, at, size = flat.view(torch.uint8).numpy().tobytes(), 0, flat.element_size()
        for name, t in group:
            out[name] = DTYPES[flat.dtype], list(t.shape), data[at:at + t.numel() * size]
            at += t.numel() * size
    return {name: out[name] for name in names}


def copy_raw(params: Mapping[str, torch.Tensor], state: Mapping[str, RawTensor], device: torch.device) -> None:
    """Each parameter set to its tensor of `state` (same shape; cast to the parameter's dtype on `device`), with one
    transfer to the device per stored dtype (per tensor, a GPU waited once per tensor: issue 47)."""
    kinds: dict[str, list[str]] = {}
    for name in params:
        kinds.setdefault(state[name][0], []).append(name)
    with torch.no_grad():
        for dtype, names in kinds.items():
            data = b"".join(state[n][2] for n in names)
            flat = torch.frombuffer(bytearray(data), dtype=TORCH_DTYPES[dtype]) if data else torch.empty(0)
            if flat.numel() != sum(params[n].numel() for n in names):
                raise ConfigError(f"the {dtype} tensors given hold {flat.numel()} values where their shapes need "
                                  f"{sum(params[n].numel() for n in names)}")
            values = flat.to(device).split([params[n].numel() for n in names])
            for name, value in zip(names, values, strict=True):
                params[name].copy_(value.view(params[name].shape))


def views_on(state: Mapping[str, RawTensor], names: Sequence[str], device: torch.device,
             dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`names`' tensors of `state` on `device` in `dtype`: per stored dtype one transfer and one cast of all their
    values, each tensor a view of it (`copy_raw` into tensors of their own cost an allocation and a copy per tensor:
    hundreds per kept point for the references, issue 47). The same values as `copy_raw`'s."""
    kinds: dict[str, list[str]] = {}
    for name in names:
        kinds.setdefault(state[name][0], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for stored, group in kinds.items():
        data = bytearray().join(state[n][2] for n in group)  # one copy of the bytes, writable as frombuffer wants
        flat = torch.frombuffer(data, dtype=TORCH_DTYPES[stored]) if data else torch.empty(0)
        sizes = [math.prod(state[n][1]) for n in group]
        if flat.numel() != sum(sizes):
            raise ConfigError(f"the {stored} tensors given hold {flat.numel()} values where their shapes need "
                              f"{sum(sizes)}")
        for name, part in zip(group, flat.to(device=device, dtype=dtype).split(sizes), strict=True):
            out[name] = part.view(list(state[name][1]))
    return out
