"""The merged weights handed over in buckets, as the user's sync does (`--loop bucket_mb`; issue 44, FIELD.md #20).

RL stacks send a full-weight update in buckets of a fixed size (verl's `update_weights_bucket_megabytes`, NeMo-RL's
refit buffer, SkyRL's transfer threshold), each bucket its own call into the engine. `split` fills a bucket in the
trainer's order until the next tensor would overflow it (a tensor is never cut; one larger than a bucket goes alone),
and `deliver` hands each to the sampler's in-place reload (`BaseReloadingSampler.reload_base` with that bucket's
tensors: every other weight stays as it is). Where a bucket boundary falls between the parts of a module the engine
packs into one (vLLM's q/k/v into `qkv_proj`, gate/up into `gate_up_proj`), the engine gets that module in two calls:
`split_modules` names them, recorded with the version (`AdapterVersion.split_modules`), so that a failure there reads
as what it is. Fault `bucket-lost` (`run.loop`): the middle bucket never reaches the engine, and nothing says so.
Pure but `deliver`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}
"""Checkpoint modules the engine packs into one (vLLM's `packed_modules_mapping` of the dense decoders)."""


def nbytes(tensor: Any) -> int:
    """A tensor's size in bytes (a plain number, the fake trainer's 'weight', counts 8)."""
    if hasattr(tensor, "numel") and hasattr(tensor, "element_size"):
        return int(tensor.numel()) * int(tensor.element_size())
    return 8


def split(tensors: Mapping[str, Any], limit: int) -> list[dict[str, Any]]:
    """`tensors` in buckets of at most `limit` bytes, in their order; a tensor larger than `limit` alone."""
    buckets: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    size = 0
    for name, tensor in tensors.items():
        n = nbytes(tensor)
        if current and size + n > limit:
            buckets.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += n
    if current:
        buckets.append(current)
    return buckets


def packed_name(name: str) -> str | None:
    """The engine's packed module of checkpoint tensor `name` (`model.layers.0.self_attn.qkv_proj`), or None."""
    module, _, _ = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    into = PACKED.get(leaf)
    return None if into is None else f"{parent}.{into}" if parent else into


def split_modules(buckets: list[dict[str, Any]]) -> list[str]:
    """The packed modules whose parts lie in more than one bucket, in order."""
    where: dict[str, set[int]] = {}
    for i, bucket in enumerate(buckets):
        for name in bucket:
            packed = packed_name(name)
            if packed is not None:
                where.setdefault(packed, set()).add(i)
    return [name for name, seen in where.items() if len(seen) > 1]


def deliver(sampler: Any, tensors: Mapping[str, Any], limit: int | None,
            lose_one: bool = False) -> tuple[list[int], list[str]] | None:
    """Hand `tensors` to `sampler.reload_base`: at once (`limit` None; returns None), or one reload per bucket
    (returns each bucket's bytes and the split packed modules). `lose_one`: the middle bucket is not sent (fault
    bucket-lost; the record still lists it, as the sender believes it sent it)."""
    if limit is None:
        sampler.reload_base(tensors=dict(tensors))
        return None
    buckets = split(tensors, limit)
    lost = len(buckets) // 2 if lose_one else -1
    for i, bucket in enumerate(buckets):
        if i != lost:
            sampler.reload_base(tensors=bucket)
    return [sum(nbytes(t) for t in b.values()) for b in buckets], split_modules(buckets)
