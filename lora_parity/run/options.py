"""The options of `lora-parity run`, below everything that reads them (runner, preflight, selftest, the
CLI): they travel down from the command line and never back up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunOptions:
    """Options of `lora-parity run`."""

    model: str | None = None
    trainer: str = "hf"
    sampler: str = "vllm"
    probes: str = "default"
    out: Path | None = None
    revision: str | None = None
    seed: int = 0
    force: bool = False
    inject: str | None = None
    sync: str = "new-id"
    update: str | None = None
    """`--update noise|step`: replaces the config's `perturbation.update`; None: the config's."""
    per_target: bool | None = None
    """`--per-target/--no-per-target`: coverage on or off whatever the config says; None: the config's
    `per_target` (`runner.prepare` resolves it, so the plan's is the one setting the sequence reads)."""
    route_replay: str | None = None
    """`--route-replay on|off|auto` (MoE models, docs/moe.md); None: the config's `route_replay`, else auto."""
    per_layer: bool = True
    """`--per-layer/--no-per-layer`: per-layer coverage after per-target coverage (`run/layer_coverage.py`)."""
    per_target_only: tuple[str, ...] | None = None
    """Per-target coverage of these target kinds only (the selftest's drop-target under --no-per-target)."""
    command: tuple[str, ...] = ()
    tinker_url: str | None = None
    """URL of the Tinker service (the tinker backends only)."""
    base_model: str | None = None
    """Base model name on the Tinker service (default: the one model it serves)."""
    tp: int = 1
    """Tensor-parallel size of the trainer (the megatron trainer only)."""
    reference: str | None = None
    """'fp32': score the base model in fp32 with HF, the reference both sides approximate; 'none': don't;
    None: score it for a bf16/fp16 model whose fp32 copy fits in memory (see `reference_decision`)."""
    exact_reference: bool = True
    """Score the exact reference where the sampler can be mirrored bit for bit (`reference_scorers.exact_scorer`)."""
    batch_invariant: bool = True
    """vLLM on CUDA: batch-invariant (deterministic) kernels, where the build has them."""
    engine_args: tuple[str, ...] = ()
    """`--engine-arg KEY=VALUE`: the user's vLLM engine arguments, over the config's `sampler.engine_args`."""
    sleep_levels: str | None = None
    """`--sleep-levels 1,2` (or `none`): the sleep levels exercised after the sync, over the config's
    `sampler.sleep_levels` (`run.sleep_wake`); None: the config's."""
    sampling: tuple[str, ...] = ()
    """`--sampling KEY=VALUE`: the user's temperature, top_p, top_k on the decode path, over the config's
    `sampler.sampling` (`models.sampling`)."""
    loop: tuple[str, ...] = ()
    """`--loop KEY=VALUE`: what the user's loop does between a sync and the next scoring, over the config's
    `sampler.loop` (`models.loop`)."""
    dtype: str | None = None
    """Cast a checkpoint passed by path to this dtype (budgets follow it); None: its config.json's."""
    adapter: Path | None = None
    """A PEFT adapter folder both sides start from instead of zero-init (`lora_parity.run.start_adapter`)."""
    budgets: str | None = None
    """Budget profile replacing the config's budgets (`config.BUDGET_PROFILES`); None: the config's own."""
    trust_remote_code: bool = False
    """`--trust-remote-code`: a config's `model.trust_remote_code: true` is refused without it."""
    sampler_url: str | None = None
    """A sampler served over HTTP (vllm-server): attach to this server instead of starting one."""
    api_key_env: str | None = None
    """Environment variable holding that server's API key (never recorded)."""
    shared_dir: Path | None = None
    """Folder the attached server can read; adapters are copied there."""
