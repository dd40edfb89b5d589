"""Mixed batches (issue 44, "The engine as deployed"): a deployed engine serves the base model and several adapter
versions in the same batch, and a LoRA slot mapped to the wrong requests there (vllm #16040, #36370) shows in no
batch of one route alone. A sampler that can score several routes in one batch is a `MixedBatchSampler`; the phase
that uses it is `run.mixed_batch`, its checks `verdict.mixed_batch`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from lora_parity.backends.base import AdapterHandle, Scores, Sequences


@runtime_checkable
class MixedBatchSampler(Protocol):
    """A sampler that scores several routes (the base model, adapter versions) in one batch, as a deployed engine
    serves them (its traits' `mixed_batch_unavailable` is None)."""

    @property
    def adapters_per_batch(self) -> int:
        """How many adapters one batch serves (vLLM's `max_loras`; the base model takes no slot)."""
        ...

    def score_mixed(self, sequences: Sequences, routes: Sequence[AdapterHandle | None]) -> list[Scores]:
        """Every sequence under every route (None: the base model), all requests in one batch, sequence by
        sequence with the routes interleaved; one `Scores` per route, in the order of `routes` (the alignment
        rule of `backends.base`)."""
        ...


CPU_LORA_DEFECT = ("this vLLM build's CPU LoRA ops apply the last loaded adapter to tokens marked no-LoRA (slot -1), "
                   "so base-model requests batched beside adapter requests get the adapter (vllm PR #48421, open at "
                   "vLLM 0.32)")
"""Why the in-process vLLM-CPU sampler mixes no batches where `cpu_lora_defect` finds the defect."""


def cpu_lora_defect() -> str | None:
    """`CPU_LORA_DEFECT` where vLLM's CPU LoRA op (`torch_ops.bgmv_expand`, which the CPU build's prefill and decode
    paths use) adds an adapter's output to a token whose slot is -1 (no LoRA), as a probe of the installed op on a
    one-token tensor shows; None where it skips such tokens, as the GPU kernels do, or the op is not there."""
    try:
        import torch
        from vllm.lora.ops.torch_ops import bgmv_expand
    except ImportError:
        return None
    out = torch.zeros(1, 2)
    bgmv_expand(torch.ones(1, 2), torch.ones(1, 2, 2), out, torch.tensor([-1]), add_inputs=True)
    return CPU_LORA_DEFECT if bool(out.abs().sum() > 0) else None
