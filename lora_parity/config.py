"""Model configs: what to load, the LoRA adapter, the perturbation, the probes and the budgets.

A config is a YAML file in `configs/` (read with `yaml.safe_load`), validated strictly. `--model`
takes a config name, a path to a YAML file, or a local HF checkpoint folder (config.json +
safetensors), which then runs with the embedded default's settings.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lora_parity.errors import ConfigError
from lora_parity.receipt import Budgets, Probes, sha256_json

DEFAULT_MODEL = "tiny-qwen3"
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SyntheticSpec(_Cfg):
    """A checkpoint generated deterministically from a seed (see `lora_parity.synthetic`)."""

    architecture: Literal["Qwen3ForCausalLM", "LlamaForCausalLM"] = "Qwen3ForCausalLM"
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


class ModelSpec(_Cfg):
    """Where the base model comes from: exactly one of synthetic, path or hf_id."""

    synthetic: SyntheticSpec | None = None
    path: str | None = None
    hf_id: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if sum(x is not None for x in (self.synthetic, self.path, self.hf_id)) != 1:
            raise ValueError("model needs exactly one of synthetic, path, hf_id")
        return self


class AdapterSpec(_Cfg):
    """The LoRA adapter both sides use."""

    rank: int = Field(gt=0)
    alpha: float = Field(gt=0)
    targets: list[str] = Field(min_length=1)


class PerturbationSpec(_Cfg):
    """The trainer-only B update: Gaussian noise of a fixed std, seeded per tensor."""

    std: float = Field(gt=0)


class ProbeSpec(_Cfg):
    """Deterministic probe sequences: token ids drawn uniformly from the vocabulary."""

    lengths: list[int] = Field(min_length=1)
    seeds: dict[str, int]

    @model_validator(mode="after")
    def _lengths(self) -> ProbeSpec:
        if any(n < 2 for n in self.lengths):
            raise ValueError("every probe sequence needs at least 2 tokens")
        return self


class SamplerSpec(_Cfg):
    """Engine settings for the vLLM sampler."""

    max_model_len: int = 512
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    enable_prefix_caching: bool = False
    """Off by default: a prompt served partly from cached KV blocks is scored differently from the same
    prompt computed whole, so repeated scoring of one state stops being exact (seen on the GPU)."""
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1


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
    per_target: bool = True
    """Run per-target coverage after C (on by default for small models)."""

    def digest(self) -> str:
        """sha256 of the config's canonical JSON."""
        return sha256_json(self.model_dump(mode="json"))


def configs_dir() -> Path:
    """`LORA_PARITY_CONFIGS`, else the repository's configs/ beside the package, else ./configs."""
    env = os.environ.get("LORA_PARITY_CONFIGS")
    if env:
        return Path(env)
    beside = Path(__file__).resolve().parent.parent / "configs"
    return beside if beside.is_dir() else Path.cwd() / "configs"


def available() -> list[Path]:
    """Config files, sorted by name."""
    d = configs_dir()
    return sorted(d.glob("*.yaml")) if d.is_dir() else []


def _load_yaml(path: Path) -> ModelConfig:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a YAML mapping")
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "(top)"
        raise ConfigError(f"{path}: invalid config: {where}: {first.get('msg')}") from None


def _from_checkpoint(path: Path) -> ModelConfig:
    """A local HF checkpoint with the embedded default's adapter, perturbation, probes and budgets."""
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: not an HF checkpoint folder (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"{path}: no .safetensors weights (lora-parity never loads pickled weights)")
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}/config.json: unreadable: {e}") from None
    base = load(DEFAULT_MODEL)
    dtype = hf.get("torch_dtype") or hf.get("dtype")
    model = ModelSpec.model_validate(
        {"path": str(path.resolve()), "dtype": dtype if dtype in ("float32", "bfloat16", "float16") else "float32"}
    )
    return base.model_copy(update={"name": path.name, "description": f"local checkpoint {path.name}", "model": model})


def load(name_or_path: str | None) -> ModelConfig:
    """Resolve `--model`: a config name, a YAML path, or a local HF checkpoint folder."""
    ref = name_or_path or DEFAULT_MODEL
    p = Path(ref)
    if p.is_dir():
        return _from_checkpoint(p)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"config file {ref} not found")
        return _load_yaml(p)
    candidate = configs_dir() / f"{ref}.yaml"
    if candidate.is_file():
        return _load_yaml(candidate)
    names = ", ".join(f.stem for f in available()) or "none"
    if "/" in ref or ref.startswith("."):
        raise ConfigError(f"model path {ref} not found (a local HF checkpoint folder or a config name: {names})")
    raise ConfigError(f"unknown model {ref!r}; configs: {names}; or pass a local checkpoint folder")


def make_probes(spec: ProbeSpec, set_name: str, vocab_size: int) -> Probes:
    """Deterministic probe sequences of `set_name`: ids uniform in [0, vocab_size), seeded.

    `NAME-xN` (e.g. `default-x10`) is set NAME with N times as many sequences, for benchmarks; its
    first sequences are NAME's own.
    """
    base, _, times = set_name.rpartition("-x")
    if not (base and times.isdigit() and int(times) >= 1):
        base, times = set_name, "1"
    if base not in spec.seeds:
        raise ConfigError(f"unknown probe set {set_name!r}; sets: {', '.join(spec.seeds)} (or SET-xN)")
    seed = spec.seeds[base]
    rng = random.Random(seed)
    sequences = [[rng.randrange(vocab_size) for _ in range(n)] for _ in range(int(times)) for n in spec.lengths]
    return Probes(
        set=set_name,
        seed=seed,
        sequences=sequences,
        digest=sha256_json(sequences),
        num_scored_positions=sum(len(s) - 1 for s in sequences),
    )


def config_summary(cfg: ModelConfig) -> dict[str, Any]:
    """One line's worth of a config, for `lora-parity models`."""
    m = cfg.model
    source = "synthetic" if m.synthetic else (m.path or m.hf_id)
    return {"name": cfg.name, "source": source, "dtype": m.dtype, "rank": cfg.adapter.rank,
            "targets": len(cfg.adapter.targets), "description": cfg.description}
