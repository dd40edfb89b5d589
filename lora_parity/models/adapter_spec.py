"""The LoRA adapter of a config (`adapter:`): rank, alpha, the target modules, and the fused routed-expert
parameters of a Qwen3-MoE model (`target_parameters`, docs/moe.md, "Expert LoRA"); and the PEFT `LoraConfig` the
HF trainer and the fp32 reference build from it (`peft_config`)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

TARGET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}(\.[A-Za-z0-9_]{1,128}){0,15}")
"""A LoRA target module name: a Python identifier, or dotted ones (`model.layers.0.q_proj`). The
names go onto `vllm serve`'s command line, so nothing else (an option such as `--host=0.0.0.0`,
a space, a shell character) is ever taken."""

EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""The only `target_parameters` taken, both and in this order: transformers 5 keeps Qwen3-MoE's routed experts as
these two fused parameters per MoE layer ([E, 2I, H] and [E, H, I]). PEFT wraps the first inside the second, so
the first's tensors are saved as `mlp.experts.base_layer.lora_A/B` and the second's as `mlp.experts.lora_A/B`
(`perturb.target_kind`); vLLM fails to load an adapter on only one of them (vllm #48460)."""
EXPERT_KINDS = ("experts.gate_up_proj", "experts.down_proj")
"""The target kinds of `EXPERT_PARAMETERS` (`perturb.target_kind`), in the same order."""


class AdapterSpec(BaseModel):
    """The LoRA adapter both sides use."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(gt=0)
    alpha: float = Field(gt=0, allow_inf_nan=False)
    targets: list[str] = Field(min_length=1)
    """Module names (`TARGET_NAME`: identifiers only, never an option or a path)."""
    target_parameters: list[str] = Field(default_factory=list)
    """Routed-expert parameters (PEFT's `target_parameters`): empty, or exactly `EXPERT_PARAMETERS`. Left out of the
    config's digest while empty (`ModelConfig.digest`)."""

    @model_validator(mode="after")
    def _target_names(self) -> AdapterSpec:
        bad = next((t for t in self.targets if not TARGET_NAME.fullmatch(t)), None)
        if bad is not None:
            raise ValueError(f"target module {bad!r} is not a module name (letters, digits, _ and .)")
        if self.target_parameters and tuple(self.target_parameters) != EXPERT_PARAMETERS:
            raise ValueError(f"target_parameters {self.target_parameters} not taken: the only ones are "
                             f"[{', '.join(EXPERT_PARAMETERS)}], both, in that order (Qwen3-MoE's routed experts)")
        return self

    @property
    def kinds(self) -> list[str]:
        """Every target kind of the adapter: the modules, then the expert parameters' (`EXPERT_KINDS`)."""
        return [*self.targets, *(EXPERT_KINDS if self.target_parameters else ())]


def peft_config(spec: AdapterSpec) -> Any:
    """PEFT's `LoraConfig` for `spec`: dropout 0, no bias, PEFT's own init (A drawn, B zero); the expert
    parameters as `target_parameters` where the spec has them."""
    import peft

    return peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),  # type: ignore[arg-type]
                           target_parameters=list(spec.target_parameters) or None, lora_dropout=0.0, bias="none",
                           init_lora_weights=True)
