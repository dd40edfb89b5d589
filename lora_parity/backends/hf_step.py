"""`--update step` for the HF + PEFT trainers (`hf`, `exact`): one AdamW step on the LoRA tensors, autograd
through PEFT, with the gradient of the start point kept for the next step from the same point.

The calibrated step searches the learning rate: every value it tries starts from the same start point on
the same sequences (`zero_b`, then `step`), so the gradient is the same each time; only AdamW's first step
(a fresh state) with another learning rate differs. The gradient is computed once per (sequences, target
kind) and start point, and every step runs `torch.optim.AdamW` on it, so a step is the optimizer's own
arithmetic whether its gradient was cached or not. On the CPU a bf16 backward of SmolLM2-135M took about 44 s
per learning rate tried.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch

from lora_parity.backends.base import Sequences
from lora_parity.evidence.receipt import Perturbation, TensorChange
from lora_parity.models import update_step
from lora_parity.models.perturb import target_kind
from lora_parity.util.errors import PhaseError

Params = list[tuple[str, torch.nn.Parameter]]


def sequences_key(sequences: Sequences, only: str | None) -> str:
    """What a cached gradient was computed for: the sequences' digest and the target kind."""
    digest = hashlib.sha256(repr([list(s) for s in sequences]).encode()).hexdigest()
    return f"{digest}:{only}"


class GradientCache:
    """The gradient of the loss at the start point, per `sequences_key`, the `size` most recently used kept (a
    run's whole update and each target kind's); `clear` where the start point moves."""

    def __init__(self, size: int = 10) -> None:
        self.grads: dict[str, dict[str, torch.Tensor]] = {}
        self.size = size
        self.computed = 0
        """Backward passes made (the rest of the steps reused one)."""

    def clear(self) -> None:
        self.grads.clear()

    def get(self, key: str, compute: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        grads = self.grads.pop(key, None)
        if grads is None:
            grads = compute()
            self.computed += 1
        self.grads[key] = grads  # the most recently used last
        while len(self.grads) > self.size:
            del self.grads[next(iter(self.grads))]
        return grads


def check_start(model: Any, params: Params, start_a: dict[str, torch.Tensor],
                start_b: dict[str, torch.Tensor] | None, only: str | None) -> None:
    """Refuse unless every chosen LoRA tensor is at the start point and no other parameter is trainable."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    if trainable:
        raise PhaseError(f"refusing to step: non-adapter parameter {trainable[0]} is trainable")
    if not params:
        raise PhaseError(f"no LoRA tensors{' of ' + only if only else ''} to step")
    for name, p in params:
        start = (start_a.get(name) if "lora_A" in name else
                 start_b[name] if start_b is not None else torch.zeros_like(p))
        if start is not None and not torch.equal(p, start):
            raise PhaseError(f"refusing to step: {name} is not at the start point")


def gradient(model: Any, params: Params, sequences: Sequences, device: torch.device) -> dict[str, torch.Tensor]:
    """d(−mean logprob of `sequences`)/d(each of `params`): every scored position, one sequence per forward,
    fp32 log-softmax; the other parameters' requires_grad put back afterwards."""
    chosen = {id(p) for _, p in params}
    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        for _, p in model.named_parameters():
            p.requires_grad_(id(p) in chosen)
            p.grad = None
        num_positions = sum(len(seq) - 1 for seq in sequences)
        for seq in sequences:
            ids = torch.tensor([seq], device=device)
            logits = model(input_ids=ids).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            (-logprobs.sum() / num_positions).backward()
        return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in params}
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])
            p.grad = None


def adamw_step(params: Params, grads: dict[str, torch.Tensor], learning_rate: float) -> None:
    """One `torch.optim.AdamW` step (betas 0.9/0.999, eps 1e-8, weight decay 0, fresh state) on `grads`."""
    optimizer = torch.optim.AdamW([p for _, p in params], lr=learning_rate, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0)
    for name, p in params:
        p.grad = grads[name].clone()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def perturbation(params: Params, before: dict[str, torch.Tensor], learning_rate: float, seed: int) -> Perturbation:
    """The receipt's record of the step: per tensor group, its L2 before and the L2 of its change."""
    changes: dict[str, list[float]] = {}
    with torch.no_grad():
        for name, p in params:
            acc = changes.setdefault(update_step.group_of(name), [0, 0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += float(before[name].double().pow(2).sum())
            acc[2] += float((p.detach().float() - before[name]).double().pow(2).sum())
            acc[3] += float(update_step.bf16_change(before[name], p.detach()).pow(2).sum())
    return Perturbation(kind="optimizer_step", seed=seed, std=0.0, num_tensors=len(params),
                        num_elements=sum(p.numel() for _, p in params), tensors=[n for n, _ in params],
                        learning_rate=learning_rate, optimizer=update_step.OPTIMIZER, objective=update_step.OBJECTIVE,
                        tensor_changes={g: TensorChange(num_tensors=int(n), l2_before=math.sqrt(b),
                                                        l2_change=math.sqrt(c), l2_change_bf16=math.sqrt(h))
                                        for g, (n, b, c, h) in sorted(changes.items())})


def step(model: Any, sequences: Sequences, learning_rate: float, seed: int, only: str | None, device: torch.device,
         start_a: dict[str, torch.Tensor], start_b: dict[str, torch.Tensor] | None,
         cache: GradientCache, routes: str = "") -> Perturbation:
    """One AdamW step on every lora_A and lora_B of `model` (or target kind `only`'s), the gradient taken at
    the start point (computed once per sequences, kind and `routes`, the digest of the routes replayed: `cache`)."""
    params: Params = [(n, p) for n, p in model.named_parameters()
                      if "lora_" in n and (only is None or target_kind(n) == only)]
    check_start(model, params, start_a, start_b, only)
    grads = cache.get(sequences_key(sequences, only) + routes, lambda: gradient(model, params, sequences, device))
    before = {n: p.detach().float().clone() for n, p in params}
    adamw_step(params, grads, learning_rate)
    return perturbation(params, before, learning_rate, seed)
