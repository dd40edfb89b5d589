"""The column blocks of the fused LoRA layers, and a user's PEFT adapter imported into them exactly.

Megatron's fused `linear_qkv` (q, k, v) and `linear_fc1` (gate, up) carry one LoRA: A (R x I) and B
(O x R) for the fused output. At zero-init every part shares A: each part's block is the columns
[0, r) of B, and the export repeats A for each part. A PEFT adapter has one A and one B per part;
`--adapter` imports it as a block structure: A = the targeted parts' A stacked (R = parts x r, in
`FUSED_PARTS` order), B block-diagonal (part j's rows of B, laid out as `layout.fused_rows` lays them
out on each rank, hold its B in columns [j r, (j+1) r), zeros elsewhere; an untargeted part's rows are
zero). The scale stays the adapter's alpha/r. The perturbation touches only the diagonal blocks, so
the export (part j: rows [j r, (j+1) r) of A, its own rows and columns of B) is a rank-r PEFT
adapter again, and an unperturbed import exports the input bit for bit.

`blocks_of` and `check_adapter` are pure (no torch): the preflight refuses, before any backend
import, an adapter this import cannot take. The rest applies the blocks to torch tensors (torch is
imported only inside them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora_parity.backends.megatron.layout import (
    FUSED_PARTS,
    LORA_MODULES,
    MODULE_OF_KIND,
    LoraModule,
    Shape,
    peft_name,
    shard_fused,
    tp_slice,
)
from lora_parity.models import adapter_files as af
from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError

if TYPE_CHECKING:
    import torch

Blocks = dict[str, tuple[int, int]]
"""For each targeted part of one LoRA module: its rows of A and columns of B, [start, stop)."""

_FLOAT_DTYPES = ("F32", "F16", "BF16")


def blocks_of(module: LoraModule, targets: Sequence[str], rank: int, imported: bool) -> Blocks:
    """The blocks of `module`'s targeted parts: every part [0, rank) at zero-init (one shared A);
    imported, the j-th targeted part in `FUSED_PARTS` order [j rank, (j+1) rank)."""
    kinds = [k for k in module.kinds if k in targets]
    if not imported:
        return {k: (0, rank) for k in kinds}
    return {k: (j * rank, (j + 1) * rank) for j, k in enumerate(kinds)}


def module_rank(blocks: Blocks) -> int:
    """The LoRA rank of the layer that holds `blocks` (R: the end of the last block)."""
    return max(stop for _, stop in blocks.values())


def expected_shapes(shape: Shape, targets: Sequence[str], rank: int) -> dict[str, list[int]]:
    """The PEFT tensors an adapter of `rank` on `targets` holds for this model, and their shapes."""
    inputs = {"o_proj": shape.num_heads * shape.head_dim, "down_proj": shape.ffn_hidden_size}
    out: dict[str, list[int]] = {}
    for layer in range(shape.num_layers):
        for kind in targets:
            out[peft_name(layer, kind, "lora_A")] = [rank, inputs.get(kind, shape.hidden_size)]
            out[peft_name(layer, kind, "lora_B")] = [shape.out_features(kind), rank]
    return out


def check_targets(folder: Path, targets: Sequence[str]) -> None:
    """Every target is a projection Megatron's layout has (q, k, v, o, gate, up, down)."""
    unknown = [t for t in targets if t not in MODULE_OF_KIND]
    if unknown:
        raise ConfigError(f"--adapter {folder}: the megatron trainer cannot import target {unknown[0]!r} "
                          f"(its LoRA layers stand for {', '.join(MODULE_OF_KIND)})")


def check_adapter(folder: Path, targets: Sequence[str], rank: int, hf_config: dict[str, Any] | None) -> None:
    """Before any backend import: the adapter's targets are Megatron's, and (where the checkpoint's
    config.json is known) its tensors are exactly those of a rank-`rank` LoRA on them, in a float
    dtype. Reads the safetensors header only."""
    check_targets(folder, targets)
    if hf_config is None:
        return
    shape = Shape.from_hf(hf_config, 1)
    header = _header(Path(folder) / af.WEIGHTS_FILE)
    expected = expected_shapes(shape, targets, rank)
    if set(header) != set(expected):
        odd = sorted(set(header) ^ set(expected))
        raise ConfigError(f"--adapter {folder}: its tensors are not a LoRA on every layer's {', '.join(targets)} "
                          f"({len(odd)} differ, e.g. {odd[0]})")
    for name, entry in header.items():
        if entry.get("dtype") not in _FLOAT_DTYPES or list(entry.get("shape", [])) != expected[name]:
            raise ConfigError(f"--adapter {folder}: {name} is {entry.get('dtype')} {entry.get('shape')}, "
                              f"the model needs a float tensor of shape {expected[name]}")


def _header(path: Path) -> dict[str, Any]:
    header = safe_read.safetensors_header(path)
    header.pop("__metadata__", None)
    return {k: v for k, v in header.items() if isinstance(v, dict)}


# --- The blocks applied to torch tensors ---------------------------------------------------------


def import_module(module: LoraModule, tensors: dict[str, torch.Tensor], layer: int, blocks: Blocks,
                  shape: Shape, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A and B of one LoRA module from the adapter's whole PEFT `tensors`."""
    import torch

    a = {k: tensors[peft_name(layer, k, "lora_A")] for k in blocks}
    b = {k: tensors[peft_name(layer, k, "lora_B")] for k in blocks}
    if not module.column_parallel:  # row-parallel: one part; A's input columns are split, B is whole
        (kind,) = blocks
        start, stop = tp_slice(a[kind].shape[1], rank, tp)
        return a[kind][:, start:stop], b[kind]
    assert module.name in FUSED_PARTS, module.name
    width = module_rank(blocks)
    parts = {}
    for kind in module.kinds:
        part = torch.zeros(shape.out_features(kind), width, dtype=next(iter(b.values())).dtype)
        if kind in blocks:
            start, stop = blocks[kind]
            part[:, start:stop] = b[kind]
        parts[kind] = part
    fused_a = torch.cat([a[k] for k in sorted(blocks, key=lambda k: blocks[k])])
    return fused_a, shard_fused(module.name, parts, rank, tp, shape)


def export_module(whole_a: torch.Tensor, whole_b: dict[str, torch.Tensor], blocks: Blocks
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each targeted part's PEFT (A, B) from one module's whole A and its parts' whole B rows: its
    block of A's rows and of B's columns (at zero-init, the shared A and the whole B)."""
    return {k: (whole_a[start:stop].clone(), whole_b[k][:, start:stop].contiguous())
            for k, (start, stop) in blocks.items()}


def noise_and_mask(module: LoraModule, noise: dict[str, torch.Tensor], blocks: Blocks, shape: Shape,
                   rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one module's B update, and the mask of the elements it may change: each
    part in `noise` (rows x r) in its own block, zero (and masked out) everywhere else."""
    import torch

    width = module_rank(blocks)
    parts, masks = {}, {}
    for kind in module.kinds:
        rows = shape.out_features(kind)
        parts[kind] = torch.zeros(rows, width)
        masks[kind] = torch.zeros(rows, width, dtype=torch.bool)
        if kind in noise:
            start, stop = blocks[kind]
            parts[kind][:, start:stop] = noise[kind]
            masks[kind][:, start:stop] = True
    if module.column_parallel:
        return (shard_fused(module.name, parts, rank, tp, shape), shard_fused(module.name, masks, rank, tp, shape))
    return parts[module.kinds[0]], masks[module.kinds[0]]


def layer_blocks(targets: Sequence[str], rank: int, imported: bool) -> dict[str, Blocks]:
    """Every LoRA module's blocks (modules without a target left out)."""
    out = {m.name: blocks_of(m, targets, rank, imported) for m in LORA_MODULES}
    return {name: b for name, b in out.items() if b}
