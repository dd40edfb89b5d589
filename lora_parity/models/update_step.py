"""`--update step`: the update a real trainer makes. The trainer starts from a seeded warm adapter
(A as initialized, B seeded noise: from B = 0 one step cannot move A, since dL/dA is proportional to
B), which is published as version 0; the update is then one AdamW step on A and B together that
raises the mean logprob of the probe tokens, its learning rate searched in the noise window
(`lora_parity.verdict.calibrate`).

Backend-neutral parts live here: the warm start (through a trainer's `load_start_adapter`), the words
the receipt records, and the per-group change summary.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lora_parity.evidence.receipt import TensorChange
from lora_parity.models import adapter_files as af
from lora_parity.models.perturb import is_lora_b, noise_seed, target_kind

OPTIMIZER = ("AdamW (torch.optim.AdamW semantics: betas 0.9/0.999, eps 1e-8, weight decay 0), fresh state, "
             "one step, every lora_A and lora_B trainable (or one target kind's), dropout 0, no clipping")
"""The optimizer step, in words (`Perturbation.optimizer`)."""
OBJECTIVE = ("maximise the mean logprob of the probe tokens (every scored position, the alignment rule in "
             "backends/base.py): a policy-gradient step with unit advantages; loss = -mean")
"""What the step maximises, in words (`Perturbation.objective`)."""


def group_of(name: str) -> str:
    """'q_proj.lora_A' for any layer's q_proj lora_A tensor."""
    return f"{target_kind(name)}.lora_{'B' if is_lora_b(name) else 'A'}"


def tensor_changes(before: Mapping[str, Sequence[float]],
                   after: Mapping[str, Sequence[float]]) -> dict[str, TensorChange]:
    """Per group (`group_of`): how many tensors, their L2 norm before, the L2 norm of their change, and of the change
    as bf16 holds it (`bf16`)."""
    sums: dict[str, list[float]] = {}
    for name, old in before.items():
        new = after[name]
        acc = sums.setdefault(group_of(name), [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += math.fsum(x * x for x in old)
        acc[2] += math.fsum((y - x) ** 2 for x, y in zip(old, new, strict=True))
        acc[3] += math.fsum((bf16(y) - bf16(x)) ** 2 for x, y in zip(old, new, strict=True))
    return {g: TensorChange(num_tensors=int(n), l2_before=math.sqrt(b), l2_change=math.sqrt(c),
                            l2_change_bf16=math.sqrt(h))
            for g, (n, b, c, h) in sorted(sums.items())}


def bf16(x: float) -> float:
    """`x` rounded to bfloat16 (through float32, to nearest even), as torch's cast rounds it."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if (bits >> 23) & 0xFF == 0xFF:  # inf or nan
        return x
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


def bf16_change(before: Any, after: Any) -> Any:
    """after − before with both rounded to bfloat16, in float64 (torch tensors): the change an engine that holds
    the adapter in bf16 applies."""
    import torch

    return after.detach().to(torch.bfloat16).double() - before.detach().to(torch.bfloat16).double()


def warm_tensors(tensors: Mapping[str, af.Tensor], std: float, seed: int) -> dict[str, af.Tensor]:
    """The adapter's tensors with every B replaced by seeded N(0, std²) (seeded per tensor as the noise
    update is, with a different stream), A unchanged."""
    out = {}
    for name, t in tensors.items():
        if is_lora_b(name):
            rng = random.Random(noise_seed(name, seed) ^ 0x5EED)
            values = [rng.gauss(0.0, std) for _ in range(math.prod(t.shape))]
            out[name] = af.Tensor.from_floats(t.dtype, t.shape, values)
        else:
            out[name] = t
    return out


def warm_start(trainer: Any, folder: Path, std: float, seed: int) -> Path:
    """Export the trainer's start adapter into the new folder `folder`, replace its B by the warm B
    (`warm_tensors`), and load it back as the trainer's start point (`load_start_adapter`)."""
    trainer.export_adapter(folder)
    config, tensors = af.read_adapter(folder)
    af.write_adapter(folder, config, warm_tensors(tensors, std, seed))
    trainer.load_start_adapter(folder)
    return folder
