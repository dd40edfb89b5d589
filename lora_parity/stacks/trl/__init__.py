"""The TRL stack: a `trl.GRPOTrainer` with a PEFT LoRA policy and `use_vllm=True`, checked through TRL's own sync
(`VLLMGeneration.sync_weights` in TRL 1.x) and TRL's own vLLM engine (docs/trl.md).

    from lora_parity.stacks.trl import ParityCallback, check_trl

    result = check_trl(trainer, sequences, out="receipts/trl.json")      # now, on a built GRPOTrainer
    ParityCallback(sequences, at_step=10, out="receipts/trl-{step}.json").attach(trainer)   # during trainer.train()

`adapters` wraps the trainer (the policy's forward, its LoRA tensors), the engine (prompt logprobs through TRL's
`LLM`, or its `VLLMClient` in server mode) and the sync as `lora_parity.api`'s protocols; `faults` plants faults in
TRL's own code paths; `callback` runs the check. This module imports neither TRL nor torch: `STACK` is what
`lora-parity run --stack trl` reads.
"""

from __future__ import annotations

from typing import Any

from lora_parity.stacks import Stack

TESTED_WITH = "1.16.0"
"""The TRL release the plugin was written and tested against (`trl` pip extra)."""

STACK = Stack(
    name="trl",
    summary="TRL's GRPOTrainer (PEFT LoRA, vLLM colocate or server), checked through TRL's own sync and vLLM engine",
    needs=("a GPU (TRL's colocate sync loads weights into vLLM, which vLLM's CPU build refuses) and TRL "
           "(pip install 'lora-parity[trl]')"),
    api="lora_parity.stacks.trl.check_trl or ParityCallback in your GRPO script (docs/trl.md)",
    extra="trl",
)

_LAZY = {"check_trl": "callback", "ParityCallback": "callback", "ParityFailed": "callback", "FAULTS": "faults",
         "TRLPolicy": "adapters", "TRLEngine": "adapters", "find_sync": "adapters"}


def __getattr__(name: str) -> Any:
    """The plugin's API, imported on first use (it imports torch and transformers)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = ["STACK", "TESTED_WITH", *_LAZY]
