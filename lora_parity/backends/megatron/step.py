"""`--update step` on a Megatron rank (`Shard.step`): one AdamW step on the LoRA layers' A and B,
autograd through megatron-core, the same objective, optimizer and settings as the `hf` trainer
(`models.update_step`).

The run starts a step from an adapter (the seeded warm start, or the user's), so the fused layers
hold each part's A and B as blocks (`blocks`): the step moves each part's own rows of A and its own
block of B, and the export gives a rank-r PEFT adapter again. The gradient elsewhere (B's
off-diagonal blocks, another target kind's block with `only`) is masked to zero before the step; with
a fresh AdamW state and no weight decay a zero gradient leaves an element exactly where it was.

Tensor parallelism: a column-parallel LoRA holds A whole on every rank and its rows of B; its
`LoRALinear` sums A's gradient over the ranks in backward (`copy_to_tensor_model_parallel_region` on
A(x)), so every rank holds the same A after the step. A row-parallel LoRA holds its columns of A
and B whole; both gradients are already this rank's own.
"""

from __future__ import annotations

from typing import Any

import torch

from lora_parity.backends.base import Sequences
from lora_parity.backends.megatron import blocks
from lora_parity.backends.megatron.layout import LORA_MODULES
from lora_parity.backends.native_ops import native_autograd_ops
from lora_parity.evidence.receipt import Perturbation, TensorChange
from lora_parity.models import update_step
from lora_parity.models.perturb import target_kind
from lora_parity.util.errors import PhaseError

Shard = Any
"""A `megatron.shards.Shard` (not imported: it imports this module)."""

Masked = tuple[torch.Tensor, torch.Tensor]
"""A parameter and the mask of the elements the step may change."""


def _masks(shard: Shard, kinds: list[str]) -> list[Masked]:
    """Each LoRA layer's A and B holding a part in `kinds`, with the elements of those parts."""
    rank = shard.cfg.adapter.rank
    out: list[Masked] = []
    for wrapped in shard.layers:
        for m in LORA_MODULES:
            chosen = [k for k in m.kinds if k in kinds]
            if not chosen:
                continue
            held = shard.blocks[m.name]
            if len(set(held.values())) < len(held):
                raise PhaseError(f"{m.name}: its parts share one A (zero-init); a step needs the start adapter "
                                 "held as blocks (the warm start or --adapter)")
            lora = wrapped[m.name]
            a, b = lora.adapter.linear_in.weight, lora.adapter.linear_out.weight
            a_mask = torch.zeros(a.shape[0], 1, dtype=torch.bool)
            for k in chosen:
                start, stop = held[k]
                a_mask[start:stop] = True
            zeros = {k: torch.zeros(shard.shape.out_features(k), rank) for k in chosen}
            _, b_mask = blocks.noise_and_mask(m, zeros, held, shard.shape, shard.rank, shard.tp)
            out += [(a, a_mask.expand_as(a).to(a.device)), (b, b_mask.to(b.device))]
    return out


def _name_of(shard: Shard, param: torch.Tensor) -> str:
    """A LoRA parameter's place, for an error: layer, module, A or B."""
    for i, wrapped in enumerate(shard.layers):
        for name, lora in wrapped.items():
            if param is lora.adapter.linear_in.weight:
                return f"layer {i} {name} A"
            if param is lora.adapter.linear_out.weight:
                return f"layer {i} {name} B"
    return "a LoRA parameter"


def _at_start(shard: Shard) -> bool:
    """Whether every LoRA tensor holds the start adapter's values, on every rank."""
    moved = 0
    for i, wrapped in enumerate(shard.layers):
        for name, lora in wrapped.items():
            b = lora.adapter.linear_out.weight
            moved += int(not torch.equal(b, shard._start_b(i, name, b)))
            if shard.start_a is not None:
                moved += int(not torch.equal(lora.adapter.linear_in.weight, shard.start_a[i][name]))
    return shard._sum_over_ranks(moved) == 0


def _loss_backward(shard: Shard, sequences: Sequences) -> None:
    """Accumulate the gradient of -mean logprob over every scored position, one sequence per forward (an MoE
    model's routes replayed where the shard replays them: `Shard.logits`)."""
    num_positions = sum(len(seq) - 1 for seq in sequences)
    for seq in sequences:
        ids = torch.tensor(seq[1:], device=shard.device)[:, None]
        logprobs = torch.log_softmax(shard.logits(seq)[0, :-1].float(), dim=-1).gather(1, ids)[:, 0]
        (-logprobs.sum() / num_positions).backward()


def _changes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
             names: list[str]) -> dict[str, TensorChange]:
    sums: dict[str, list[float]] = {}
    for name in names:
        old, new = before[name].double(), after[name].double()
        acc = sums.setdefault(update_step.group_of(name), [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += float(old.pow(2).sum())
        acc[2] += float((new - old).pow(2).sum())
        acc[3] += float(update_step.bf16_change(before[name], after[name]).pow(2).sum())
    return {g: TensorChange(num_tensors=int(n), l2_before=b**0.5, l2_change=c**0.5, l2_change_bf16=h**0.5)
            for g, (n, b, c, h) in sorted(sums.items())}


def step(shard: Shard, sequences: Sequences, learning_rate: float, seed: int,
         only: str | None = None) -> dict[str, Any]:
    """One `torch.optim.AdamW` step (betas 0.9/0.999, eps 1e-8, weight decay 0, fresh state) on the A
    and B of every target kind (or of kind `only`), loss = -mean logprob of `sequences` (fp32
    log-softmax of the vocabulary-gathered logits). Refuses unless every LoRA tensor is at the start
    point, or if a non-adapter parameter is trainable. The `Perturbation`, as JSON."""
    kinds = shard.update_kinds("step", only, "LoRA tensors")
    if not _at_start(shard):
        raise PhaseError("refusing to step: a LoRA tensor is not at the start point")
    masked = _masks(shard, kinds)
    before = {n: t.clone() for n, t in shard.adapter_tensors().items()}  # on the CPU some are views of the model's
    saved = {id(p): p.requires_grad for p in shard.model.parameters()}
    chosen = {id(p) for p, _ in masked}
    try:
        for p in shard.model.parameters():
            p.requires_grad_(id(p) in chosen)
        optimizer = torch.optim.AdamW([p for p, _ in masked], lr=learning_rate, betas=(0.9, 0.999), eps=1e-8,
                                      weight_decay=0.0)
        optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad(), native_autograd_ops():  # vLLM's in-process kernels record no autograd
            _loss_backward(shard, sequences)
        for p, mask in masked:
            if p.grad is None:
                raise PhaseError(f"refusing to step: {_name_of(shard, p)} got no gradient (it took no part in "
                                 "the forward that the loss was taken from)")
            p.grad.mul_(mask)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        for p in shard.model.parameters():
            p.requires_grad_(saved[id(p)])
    after = shard.adapter_tensors()
    names = [n for n in before if target_kind(n) in kinds]
    return Perturbation(kind="optimizer_step", seed=seed, std=0.0, num_tensors=len(names),
                        num_elements=sum(before[n].numel() for n in names), tensors=names,
                        learning_rate=learning_rate, optimizer=update_step.OPTIMIZER,
                        objective=update_step.OBJECTIVE,
                        tensor_changes=_changes(before, after, names)).model_dump(mode="json")
