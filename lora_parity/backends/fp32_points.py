"""The fp32 reference at the points the trainer moved to: the base model in fp32 carrying the trainer's own
LoRA tensors (upcast), scored where each judgement after a change is made (the updated point, each
per-target point). It tells how far each half-precision side is from the true value there, and so which
side a disagreement after the change comes from (docs/verdicts.md, "Noise where each judgement is made").

The tensors come from the trainer's memory (`TensorReadingTrainer.lora_tensors`), never from a file: a
reader that is wrong for the engine is not asked here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import peft
import torch

from lora_parity.backends.base import RouteTable, Scores, Sequences, groups
from lora_parity.backends.hf import load_base, pack_tokens, pick_device, score_sequences
from lora_parity.backends.moe import forced_routes
from lora_parity.backends.raw_tensors import copy_raw
from lora_parity.backends.reference_base import (
    ReferenceBase,
    free_bytes,
    lora_pairs,
    plain_lora,
    plain_targets,
    scaling,
)
from lora_parity.models.adapter_spec import peft_config
from lora_parity.models.config import ModelConfig
from lora_parity.models.fresh_adapter import RawTensor
from lora_parity.util.errors import ConfigError

States = Sequence[Mapping[str, RawTensor]]
PointScorer = Callable[..., list[Scores]]
"""(sequences, states[, routes]) -> one `Scores` per state; routes, where given, one `RouteTable` (or None) per
state, replayed at that point (`moe.forced_routes`)."""


def fp32_points(cfg: ModelConfig, model_dir: Path, base: ReferenceBase | None = None) -> PointScorer:
    """A scorer of the fp32 base model with each given set of LoRA tensors (PEFT's saved names): the run's shared
    load (`base`, plain LoRA by hooks: `reference_base`) where given and the adapter is plain LoRA, else one load
    of its own, freed afterwards (`with_states`)."""

    def forward(model: torch.nn.Module, sequences: Sequences, device: torch.device) -> Scores:
        return score_sequences(model, sequences, device, cfg.scoring.batch_size, pack_tokens(cfg, model))

    own = with_states(cfg, model_dir, "float32", forward)
    if base is None:
        return own

    def score(sequences: Sequences, states: States,
              routes: Sequence[RouteTable | None] | None = None) -> list[Scores]:
        model = base.model()
        targets = plain_targets(cfg, model)
        if targets is None:
            base.release()  # PEFT's wrap loads its own
            return own(sequences, states, routes)
        if routes is None:
            return packed_points(cfg, model, targets, sequences, states, base.device)
        out = []
        for state, table in zip(states, routes, strict=True):  # each point with its own routes: a forward each
            pairs = lora_pairs(state, targets, "fp32 reference", base.device, torch.float32)
            with plain_lora(targets, [pairs], scaling(cfg)), \
                    forced_routes(model, table) if table is not None else contextlib.nullcontext():
                out.append(forward(model, sequences, base.device))
        return out

    return score


def packed_points(cfg: ModelConfig, model: torch.nn.Module, targets: Mapping[str, torch.nn.Linear],
                  sequences: Sequences, states: States, device: torch.device) -> list[Scores]:
    """The fp32 model's scores with each of `states` (plain LoRA by hooks), as many points in one forward as fit in
    the trainer's `scoring.pack_tokens` padded tokens (each point's copy of a group of sequences its own rows,
    `plain_lora`): one forward per group and point cost about the same on a GPU, its launches. Where a group alone
    fills the pack (or the config packs by sequences), one point per forward, as one point alone is scored."""
    pack = pack_tokens(cfg, model)
    parts = groups(sequences, cfg.scoring.batch_size, pack)
    padded = [len(sequences[p]) * max(map(len, sequences[p])) for p in parts]  # each group's tokens, right-padded
    per_forward = max(1, pack // max(padded, default=1)) if pack else 1
    out: list[Scores] = []
    for first in range(0, len(states), per_forward):
        chunk = [lora_pairs(state, targets, "fp32 reference", device, torch.float32)
                 for state in states[first:first + per_forward]]
        scores: list[Scores] = [[] for _ in chunk]
        for part in parts:
            group = list(sequences[part])
            with plain_lora(targets, chunk, scaling(cfg), rows=len(group)):
                got = score_sequences(model, group * len(chunk), device, len(group) * len(chunk))
            for i, point in enumerate(scores):
                point += got[i * len(group):(i + 1) * len(group)]
        out += scores
    return out


Forward = Callable[[torch.nn.Module, Sequences, torch.device], Scores]


def with_states(cfg: ModelConfig, model_dir: Path, dtype: str, forward: Forward, what: str = "fp32 reference",
                device: torch.device | None = None) -> PointScorer:
    """A scorer of the base model in `dtype` with each given set of LoRA tensors, by `forward`, in one load freed
    afterwards (with `routes`, each state's replayed: `PointScorer`). A set that lacks a tensor the config's
    targets need, or has one of another shape, is refused: the reference must carry exactly the trainer's
    adapter. Each tensor is copied into the PEFT model's own parameter dtype, as the trainer holds it."""

    def score(sequences: Sequences, states: States,
              routes: Sequence[RouteTable | None] | None = None) -> list[Scores]:
        where = device or pick_device()
        base = load_base(cfg, model_dir, where, dtype=dtype)
        model = peft.get_peft_model(base, peft_config(cfg.adapter)).to(where).eval()
        params = {n.replace(".default.weight", ".weight"): p for n, p in model.named_parameters() if "lora_" in n}
        try:
            out = []
            for i, state in enumerate(states):
                for name, p in params.items():
                    if name not in state:
                        raise ConfigError(f"{what}: the trainer's tensors have no {name}")
                    if list(state[name][1]) != list(p.shape):
                        raise ConfigError(f"{what}: {name} is {list(state[name][1])}, expected {list(p.shape)}")
                copy_raw(params, state, where)
                table = routes[i] if routes is not None else None
                with forced_routes(model, table) if table is not None else contextlib.nullcontext():
                    out.append(forward(model, sequences, where))
            return out
        finally:
            del model, base
            if where.type == "cuda":
                torch.cuda.empty_cache()

    return score


def fp32_reference_memory(model_dir: Path) -> tuple[int, int]:
    """(bytes of the fp32 copy's parameters, bytes available for it now: free GPU memory where the
    reference would run on CUDA, else the host's available RAM). Reads only the safetensors headers."""
    from safetensors import safe_open

    num_params = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            num_params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return 4 * num_params, free_bytes(pick_device())
