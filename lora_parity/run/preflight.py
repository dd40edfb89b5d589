"""Preflight checks of `lora-parity run` that need the resolved config and backend classes, before
anything loads (`runner.prepare` calls them), and the fp32 reference decision."""

from __future__ import annotations

import os
from collections.abc import Callable

from lora_parity import backends
from lora_parity.backends.base import (
    BackendTraits,
    PreflightOptions,
    SamplerBackend,
    SteppingTrainer,
    TensorReadingTrainer,
    TrainerBackend,
)
from lora_parity.evidence import outpath
from lora_parity.evidence.receipt import Probes, Reference
from lora_parity.models import config, sampling
from lora_parity.models.checkpoint import bos_token, preflight_hf_config, require_safetensors, vocab_size
from lora_parity.models.loop import LoopSpec
from lora_parity.run import generation, loop, start_adapter
from lora_parity.run import probes as probe_sources
from lora_parity.run.faults import Faults, check_crash_phase, require_applies
from lora_parity.run.options import RunOptions
from lora_parity.run.phase_list import phase_names
from lora_parity.run.sleep_faults import require_levels
from lora_parity.run.sync import SyncMode
from lora_parity.run.sync import mode as sync_mode_named
from lora_parity.util import cache
from lora_parity.util.errors import ConfigError

REFERENCES = ("fp32", "none")
REFERENCE_MARGIN = 1.5
"""The fp32 reference is scored by default only where 1.5 times its parameter bytes are available
(activations, the allocator's slack, and the other side still loaded)."""


def reference_preflight(reference: str | None, needs_checkpoint: bool) -> None:
    """--reference is fp32 or none, and fp32 only where a backend loads the checkpoint."""
    if reference is None:
        return
    if reference not in REFERENCES:
        raise ConfigError(f"unknown reference {reference!r}; choose from {', '.join(REFERENCES)}")
    if reference == "fp32" and not needs_checkpoint:
        raise ConfigError("--reference fp32 loads the checkpoint with HF; these backends use none")


def reference_decision(choice: str | None, needs_checkpoint: bool, dtype: str,
                       measure: Callable[[], tuple[int, int]]) -> Reference:
    """Whether to score the fp32 reference: asked for (`fp32`), refused (`none`), or by default (None)
    for a bf16/fp16 model whose fp32 copy fits (`measure()`: its bytes, the bytes available)."""
    if choice == "none":
        return Reference(status="skipped", reason="turned off (--reference none)")
    if not needs_checkpoint:
        return Reference(status="skipped", reason="these backends load no checkpoint (the Python API scores one given "
                                                  "reference=FOLDER, the base model's checkpoint)")
    if choice == "fp32":
        return Reference(status="scored", reason="asked for (--reference fp32)")
    if dtype == "float32":
        return Reference(status="skipped", reason="the model is fp32: the trainer's own scores are the fp32 reference")
    need, available = measure()
    if need * REFERENCE_MARGIN > available:
        return Reference(status="skipped", fp32_bytes=need, available_bytes=available,
                         reason=f"an fp32 copy ({need / 2**30:.2f} GiB, x{REFERENCE_MARGIN} margin) does not fit "
                                f"in the {available / 2**30:.2f} GiB available")
    return Reference(status="scored", fp32_bytes=need, available_bytes=available,
                     reason=f"{dtype} model: scored in fp32 by default (the copy fits)")


def tp_preflight(opts: RunOptions, trainer_cls: type[TrainerBackend]) -> None:
    """--tp is a positive size, and other than 1 only for a trainer that runs tensor parallel."""
    if opts.tp < 1:
        raise ConfigError(f"--tp must be at least 1, not {opts.tp}")
    if opts.tp != 1 and not trainer_cls.traits.supports_tp:
        raise ConfigError(f"--tp applies to the megatron trainer only, not {opts.trainer!r}")


def shape_preflight(cfg: config.ModelConfig, opts: RunOptions, trainer_cls: type[TrainerBackend]) -> None:
    """The trainer can build the checkpoint's shape at --tp, judged from config.json before any load."""
    hf = preflight_hf_config(cfg) if trainer_cls.traits.needs_checkpoint else None
    if hf is not None:
        trainer_cls.check_config(hf, opts.tp)


def sampler_preflight(opts: RunOptions, sampler_cls: type[SamplerBackend], pre: PreflightOptions,
                      cfg: config.ModelConfig) -> None:
    """Server options only for a sampler served over HTTP; then the sampler's own `preflight` (an
    attached server answers within seconds; sglang is installed or attached); a vLLM server started here
    sleeps only in the user's sleep mode (checked before its early launch)."""
    if (opts.sampler_url or opts.api_key_env or opts.shared_dir) and not sampler_cls.traits.served_over_http:
        raise ConfigError("--sampler-url, --api-key-env and --shared-dir apply to a sampler served over HTTP only "
                          "(--sampler vllm-server or sglang)")
    sampler_cls.preflight(pre)
    if opts.sampler == "vllm-server" and opts.sampler_url is None and cfg.sampler.sleep_levels:
        from lora_parity.backends.vllm_server import refuse_sleep_without_mode

        refuse_sleep_without_mode(cfg)


def service_preflight(opts: RunOptions, trainer_cls: type[TrainerBackend], sampler_cls: type[SamplerBackend],
                       pre: PreflightOptions) -> None:
    """Service options only where a backend takes them; then the trainer's own `preflight` (the
    tinker backends: the service answers within seconds)."""
    if (opts.tinker_url or opts.base_model) and not any(c.traits.takes_service_options
                                                        for c in (trainer_cls, sampler_cls)):
        raise ConfigError("--tinker-url and --base-model apply to the tinker backends only")
    trainer_cls.preflight(pre)


def _tempered_fault(inject: str | None, tempered: float | None) -> None:
    """`ConfigError` where the injected fault of the decode path cannot act with (or without) tempered logprobs."""
    name = (inject or "").partition("=")[0]
    if name in generation.UNTEMPERED_FAULTS and tempered is not None:
        raise ConfigError(f"fault {name!r} does not apply with tempered decode logprobs: "
                          f"{generation.UNTEMPERED_FAULTS[name]}")
    if name in generation.TEMPERED_FAULT_NAMES and tempered is None:
        raise ConfigError(f"fault {name!r} needs processed decode logprobs under your sampling (--engine-arg "
                          "logprobs_mode=processed_logprobs --sampling temperature=T, top_k or top_p)")


def _loop_fault(inject: str | None, spec: LoopSpec) -> None:
    """`ConfigError` where the injected fault is one the user's loop leaves out (`loop.off`)."""
    name = (inject or "").partition("=")[0]
    left_out = loop.off(spec)
    if name in left_out:
        raise ConfigError(f"fault {name!r} does not apply to this loop: {left_out[name]}")


def check_options(opts: RunOptions, cfg: config.ModelConfig) -> None:
    """Every option value that can be checked without importing a backend (torch, vLLM, transformers
    come with the backends): backend names (built in or an installed plugin's) and pairs, --inject, --reference,
    --tp, --sampling, an existing --out. Bad input is refused in well under a second."""
    backends.require_known("trainer", opts.trainer)  # an installed plugin's name too (nothing imported yet)
    backends.require_known("sampler", opts.sampler)
    paired = next((name for name in (opts.trainer, opts.sampler) if name in backends.PAIRED), None)
    if paired is not None and opts.trainer != opts.sampler:
        raise ConfigError(f"the {paired} backends work as a pair: --trainer {paired} --sampler {paired}")
    mirrored = backends.MIRRORS.get(opts.trainer)
    if mirrored is not None and opts.sampler != mirrored:
        raise ConfigError(f"--trainer {opts.trainer} mirrors the in-process {mirrored} sampler, not {opts.sampler}")
    if mirrored is not None and not sync_mode_named(opts.sync).sampler_lora:
        raise ConfigError(f"--trainer {opts.trainer} mirrors {mirrored}'s LoRA kernels; --sync {opts.sync} serves "
                          "merged weights")
    Faults(opts.inject, cfg.adapter.kinds, 1, cfg.budgets.mean, opts.sync,
           sampled=opts.probes.partition(":")[0] == "sampled")  # the probes themselves are checked later
    check_crash_phase(opts.inject, phase_names(cfg))  # a typo'd phase would never crash, and the run would pass
    require_levels(opts.inject, cfg.sampler.sleep_levels)  # a sleep fault where no sleep phase runs would never act
    if opts.sampler == "sglang" and opts.sampler_url and cfg.sampler.engine_args:
        raise ConfigError("--engine-arg with --sampler sglang goes on the command line of a server lora-parity starts; "
                          "an attached server runs with its own (its /server_info is recorded)")
    why = sampling.refusal(cfg.sampler.sampling, opts.sampler, cfg.sampler.engine_args, opts.trainer,
                           sampled=opts.probes.partition(":")[0] == "sampled")
    if why is not None:
        raise ConfigError(why)
    _tempered_fault(opts.inject, sampling.tempered(cfg.sampler.sampling, cfg.sampler.engine_args))
    _loop_fault(opts.inject, cfg.sampler.loop)
    if opts.reference is not None and opts.reference not in REFERENCES:
        raise ConfigError(f"unknown reference {opts.reference!r}; choose from {', '.join(REFERENCES)}")
    _check_values(opts)
    expert_lora_preflight(opts, cfg)
    start_adapter.check_for_trainer(opts.adapter, opts.trainer, cfg)
    if opts.out is not None:
        outpath.check_writable(opts.out, opts.force)


def expert_lora_preflight(opts: RunOptions, cfg: config.ModelConfig) -> None:
    """`adapter.target_parameters` (expert LoRA, docs/moe.md): built so far by the HF trainer, applied by the HF
    sampler, and by vLLM on CUDA (`EXPERT_LORA_ENGINES`: PEFT's fused file as it is, `enable_mixed_moe_lora_format`
    and `is_3d_lora_weight`; vLLM-CPU has no MoE-LoRA kernel), through a sync that publishes the adapter, without a
    start adapter."""
    if not cfg.adapter.target_parameters:
        return
    what = "adapter.target_parameters (expert LoRA)"
    if opts.sampler not in ("hf", *EXPERT_LORA_ENGINES):
        raise ConfigError(f"{what}: --sampler {opts.sampler} cannot apply it; use --sampler hf, or vllm / "
                          "vllm-server on an NVIDIA GPU")
    if opts.sampler in EXPERT_LORA_ENGINES and no_cuda_here():
        raise ConfigError(f"{what}: --sampler {opts.sampler} applies it on CUDA only (vLLM's MoE-LoRA kernel is "
                          "Triton; the CPU build has none) and this machine has no NVIDIA GPU; use --sampler hf")
    if opts.trainer != "hf":
        raise ConfigError(f"{what}: --trainer {opts.trainer} does not build it; use --trainer hf")
    if opts.sync not in ("new-id", "inplace"):
        raise ConfigError(f"{what}: --sync {opts.sync} does not publish it as a LoRA adapter; use new-id or inplace")
    if opts.adapter is not None:
        raise ConfigError(f"{what}: a start adapter (--adapter) with expert LoRA is not supported yet")


EXPERT_LORA_ENGINES = ("vllm", "vllm-server")
"""The engines that apply expert LoRA on CUDA (`vllm_options.expert_lora`)."""
NVIDIA_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia/version")
"""What a machine with an NVIDIA driver has, looked at without importing torch."""


def no_cuda_here() -> bool:
    """No NVIDIA driver on this machine, or CUDA_VISIBLE_DEVICES hides every GPU (judged without torch)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    return hidden or not any(os.path.exists(node) for node in NVIDIA_NODES)


def _check_values(opts: RunOptions) -> None:
    """--tp, --seed, the cache folder and the exact trainer's GPU: what would fail only after the backends
    loaded."""
    if opts.trainer == "exact" and no_cuda_here():  # vLLM's own CUDA kernels: nothing to mirror on a CPU
        raise ConfigError("--trainer exact runs vLLM's CUDA operations; this machine has no NVIDIA GPU")
    if opts.tp < 1:
        raise ConfigError(f"--tp must be at least 1, not {opts.tp}")
    if not 0 <= opts.seed < 2**63:  # torch and numpy seeds are 64-bit: a larger one fails after the model loaded
        raise ConfigError(f"--seed must be in [0, 2**63), not {opts.seed}")
    root = cache.cache_root()
    if root.exists() and not root.is_dir():  # else the first build into it fails, after the imports
        raise ConfigError(f"{cache.CACHE_ENV}={root}: not a folder")


UPDATES = ("noise", "step")
"""The `--update` kinds (`PerturbationSpec.update`)."""


def with_update(cfg: config.ModelConfig, update: str | None) -> config.ModelConfig:
    """The config with `--update` in place of its `perturbation.update` (None: as it is); bad input is a
    `ConfigError`."""
    if update is None:
        return cfg
    if update not in UPDATES:
        raise ConfigError(f"unknown update {update!r}; choose from {', '.join(UPDATES)}")
    return cfg.model_copy(update={"perturbation": cfg.perturbation.model_copy(update={"update": update})})


def before_backends(opts: RunOptions, cfg: config.ModelConfig) -> tuple[config.ModelConfig, Probes]:
    """The first stage, before any backend is imported: `--update` applied to the config (returned), a
    run this machine cannot hold (`plan.preflight`), every option value (`check_options`) and the probes
    (returned). Bad input stops here in well under a second."""
    from lora_parity.run import plan as launch_plan

    cfg = with_update(cfg, opts.update)
    launch_plan.preflight(cfg, opts.trainer, opts.sampler)
    check_options(opts, cfg)
    return cfg, make_probes(opts, cfg)


def make_probes(opts: RunOptions, cfg: config.ModelConfig) -> Probes:
    """The run's probes, every line of a probe file checked, before any backend is imported (a text
    source reads the checkpoint's tokenizer files, with the `tokenizers` library alone)."""
    return probe_sources.make(cfg, opts.probes, lambda: vocab_size(cfg), lambda: bos_token(cfg))


def backend_checks(opts: RunOptions, cfg: config.ModelConfig, trainer_cls: type[TrainerBackend],
                   sampler_cls: type[SamplerBackend], pre: PreflightOptions, sync: SyncMode,
                   probes: Probes) -> None:
    """The checks that need both backend classes (`runner.prepare`, once the trainer's libraries are
    imported): the service, --tp, the checkpoint's shape, --adapter, the probes against the sampler,
    --inject, the sync mode, --reference, safetensors weights, and fp32 or sleep levels on CUDA for vLLM."""
    service_preflight(opts, trainer_cls, sampler_cls, pre)
    tp_preflight(opts, trainer_cls)
    shape_preflight(cfg, opts, trainer_cls)
    start_adapter.require(opts.adapter, trainer_cls, opts.trainer, sampler_cls, opts.sampler)
    if cfg.perturbation.update == "step" and not issubclass(trainer_cls, SteppingTrainer):
        raise ConfigError(f"--update step: trainer {opts.trainer!r} cannot take an optimizer step on LoRA A and B "
                          "yet; use --update noise")
    sampled = generation.require(probes, sampler_cls, opts.sampler)
    Faults(opts.inject, cfg.adapter.kinds, probes.num_scored_positions, cfg.budgets.mean, opts.sync,
           sampled=sampled)
    require_applies(opts.inject, sampler_cls.built_traits(cfg), opts.sampler,
                    issubclass(trainer_cls, TensorReadingTrainer), opts.trainer)
    sync.require(trainer_cls, sampler_cls, opts.trainer, opts.sampler)
    loop.require(cfg.sampler.loop, sampler_cls, opts.sampler, opts.sync)
    needs_checkpoint = trainer_cls.traits.needs_checkpoint or sampler_cls.traits.needs_checkpoint
    reference_preflight(opts.reference, needs_checkpoint)
    if needs_checkpoint:
        require_safetensors(cfg)
    if opts.sampler == "vllm":
        from lora_parity.backends.vllm import refuse_fp32_on_cuda, refuse_sleep_without_mode

        refuse_fp32_on_cuda(cfg)
        refuse_sleep_without_mode(cfg)


def balance_where_it_holds(cfg: config.ModelConfig, trainer: BackendTraits,
                           sampler: BackendTraits) -> config.ModelConfig:
    """The config with the noise rule's `fp32_balance` kept only where both sides score at the checkpoint's precision
    (`BackendTraits.at_checkpoint_precision`): a side that is fp32-exact (the fake backends) or of unknown precision
    (a Tinker service) is not equally far from fp32 for a good reason. The receipt's budgets record what applied."""
    rule = cfg.budgets.noise
    both = trainer.at_checkpoint_precision and sampler.at_checkpoint_precision
    if rule is None or rule.fp32_balance is None or both:
        return cfg
    budgets = cfg.budgets.model_copy(update={"noise": rule.model_copy(update={"fp32_balance": None})})
    return cfg.model_copy(update={"budgets": budgets})
