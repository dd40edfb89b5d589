"""The `launch` section of a model config: the resources and parallel layout of a run too big for one
process (the trainer's torchrun job, the vLLM sampler beside it), which `lora_parity.run.plan` renders."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


# The base of `config`'s models too: config imports this module, so this one cannot import it from there.
class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TrainerLaunch(_Cfg):
    """How the trainer is spread: one torchrun job over `nodes` nodes."""

    backend: str
    """Trainer backend the plan runs (`--trainer`)."""
    nodes: int = Field(gt=0)
    """Nodes the trainer job spans (torchrun --nnodes)."""
    tp: int = Field(default=1, gt=0)
    """Tensor parallel size."""
    ep: int = Field(default=1, gt=0)
    """Expert parallel size (MoE)."""
    pp: int = Field(default=1, gt=0)
    """Pipeline parallel size."""


class SamplerLaunch(_Cfg):
    """How the vLLM sampler is spread: one engine beside trainer rank 0."""

    tp: int = Field(default=1, gt=0)
    """Tensor parallel size (GPUs of node 0)."""
    expert_parallel: bool = False
    """vLLM enable_expert_parallel: experts sharded over the TP ranks (EP = TP) instead of each split by TP."""
    own_node: bool = False
    """On a node of its own (the one after the trainer's), its workers placed there by Ray
    (distributed_executor_backend='ray'); else on node 0's GPUs beside the trainer."""


class LaunchSpec(_Cfg):
    """Resources and parallel layout of a multi-GPU, multi-node run (rendered by `lora_parity.run.plan`)."""

    gpus_per_node: int = Field(gt=0)
    """GPUs on each node."""
    gpu_memory_gib: float = Field(gt=0)
    """Memory of one GPU the plan is sized for."""
    num_params: float = Field(gt=0)
    """Parameters of the base model (all experts), for the memory estimate."""
    trainer: TrainerLaunch
    """The trainer's layout."""
    sampler: SamplerLaunch
    """The sampler's layout."""
    rdzv_port: int = 29500
    """torchrun rendezvous port on the first node."""
    requires: list[str] = []
    """What does not exist yet and must before the plan can run; the plan lists it."""

    @model_validator(mode="after")
    def _fits(self) -> LaunchSpec:
        world = self.trainer.nodes * self.gpus_per_node
        t = self.trainer
        if world % (t.tp * t.pp) != 0:
            raise ValueError(f"trainer tp x pp = {t.tp * t.pp} does not divide its {world} GPUs")
        if (world // t.pp) % t.ep != 0:
            raise ValueError(f"trainer ep {t.ep} does not divide the {world // t.pp} GPUs of a pipeline stage")
        if self.sampler.tp > self.gpus_per_node:
            raise ValueError(f"sampler tp {self.sampler.tp} exceeds the {self.gpus_per_node} GPUs of node 0")
        return self
