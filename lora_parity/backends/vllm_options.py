"""The vLLM engine options of a config, built in one place: read by the `vllm` sampler, by the MoE
helpers and by `lora-parity run --plan`. Pure: vllm is imported only by `private_dist_store`, which
the sampler calls."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lora_parity.backends import vllm_routes
from lora_parity.backends.base import routes_experts
from lora_parity.models.config import ModelConfig
from lora_parity.util import safe_read, scratch
from lora_parity.util.errors import LoraParityError, ScoreError

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM accepts."""


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds `rank`."""
    return next((r for r in LORA_RANKS if r >= rank), rank)


def _extras(cfg: ModelConfig, cuda: bool) -> dict[str, Any]:
    """MoE / MLA options from the config, and a launch plan's parallel layout on the GPU."""
    extras: dict[str, Any] = {}
    if cfg.sampler.attention_backend:
        extras["attention_backend"] = cfg.sampler.attention_backend
    if cfg.sampler.custom_ops:
        extras["custom_ops"] = list(cfg.sampler.custom_ops)
    if cuda and cfg.launch is not None:
        s = cfg.launch.sampler
        extras["tensor_parallel_size"] = s.tp
        if s.expert_parallel:
            extras["enable_expert_parallel"] = True
        if s.own_node:
            extras["distributed_executor_backend"] = "ray"
    return extras


def returns_routes(cfg: ModelConfig, model: str) -> bool:
    """An MoE model, whose engine on CUDA returns its routes: a synthetic shape with experts, or a checkpoint folder
    whose config.json names them."""
    if cfg.model.synthetic is not None:
        return cfg.model.synthetic.moe is not None
    config = Path(model) / "config.json"
    return config.is_file() and routes_experts(safe_read.read_json(config))


def expert_lora(cfg: ModelConfig) -> bool:
    """The adapter holds routed-expert LoRA (`adapter.target_parameters`, docs/moe.md): vLLM loads PEFT's fused file
    as it is only with `enable_mixed_moe_lora_format` on the engine and `is_3d_lora_weight` on each load (vLLM 0.26:
    `LoRAModelManager._convert_3d_to_2d_moe_lora` splits it per expert), and puts LoRA on the MoE layers' `experts`
    module only where the deployment's target modules name it."""
    return bool(cfg.adapter.target_parameters)


def lora_modules(cfg: ModelConfig) -> list[str]:
    """The modules the engine puts LoRA on: the adapter's targets, and `experts` for expert LoRA."""
    return [*cfg.adapter.targets, *(["experts"] if expert_lora(cfg) else [])]


def engine_options(cfg: ModelConfig, model: str, cuda: bool, lora: bool = True) -> dict[str, Any]:
    """The engine's options for `cfg` (JSON-able: the receipt records them, less `model`). `lora`:
    LoRA enabled for the adapter's own target modules (off in the merged sync modes). The user's
    `sampler.engine_args` (checked by `engine_args.check`) replace lora-parity's defaults key by key."""
    options: dict[str, Any] = {
        "model": model,
        "dtype": cfg.model.dtype,
        "enable_lora": lora,
        "skip_tokenizer_init": True,
        "enforce_eager": cfg.sampler.enforce_eager,
        "enable_prefix_caching": cfg.sampler.enable_prefix_caching,
        "max_model_len": cfg.sampler.max_model_len,
        "seed": 0,
        "trust_remote_code": cfg.model.trust_remote_code,
        "load_format": "safetensors",  # never a pickle, even beside safetensors files
    }
    if lora:
        options.update(max_lora_rank=max_lora_rank(cfg.adapter.rank), max_loras=1,
                       lora_target_modules=lora_modules(cfg))
        if expert_lora(cfg):
            options["enable_mixed_moe_lora_format"] = True
        if cfg.sampler.lora_dtype is not None:
            options["lora_dtype"] = cfg.sampler.lora_dtype
    if cuda:
        if returns_routes(cfg, model):  # the engine returns each pass's routes, which the trainer replays (R3)
            options[vllm_routes.ENGINE_ARG] = True
        options["gpu_memory_utilization"] = cfg.sampler.gpu_memory_utilization
        options["tensor_parallel_size"] = cfg.sampler.tensor_parallel_size
        if cfg.sampler.gpu_kv_cache_gib is not None:
            options["kv_cache_memory_bytes"] = int(cfg.sampler.gpu_kv_cache_gib * 2**30)
    options.update(_extras(cfg, cuda))
    if not cuda and prefix_caching(cfg):
        # vLLM-CPU's default block of 128 tokens would leave the probes' prefixes almost no full block to read
        # back (as the served sampler's --block-size 32), and the prefix-cache phases nothing to test.
        options["block_size"] = 32
    options.update(cfg.sampler.engine_args)  # as the user deploys: their values over lora-parity's defaults
    return options


def llm_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments from engine options: custom_ops goes into compilation_config."""
    kwargs = {k: v for k, v in options.items() if k != "custom_ops"}
    if options.get("custom_ops"):
        kwargs["compilation_config"] = {"custom_ops": list(options["custom_ops"])}
    return kwargs


def llm_call(options: dict[str, Any]) -> str:
    """The `vllm.LLM(...)` call these options make, as text."""
    return "vllm.LLM(" + ", ".join(f"{k}={v!r}" for k, v in llm_kwargs(options).items()) + ")"


_DEFAULT_ON = ("enable_prefix_caching",)
"""Boolean options that `vllm serve` turns on unless told `--no-...`."""


def _flag(key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else [f"--no-{key.replace('_', '-')}"] if key in _DEFAULT_ON else []
    if isinstance(value, list):
        return [flag, *(str(v) for v in value)]
    return [flag, str(value)]


def serve_command(options: dict[str, Any]) -> str:
    """The equivalent `vllm serve` command line."""
    parts = ["vllm", "serve", str(options["model"])]
    for key, value in llm_kwargs(options).items():
        if key == "compilation_config":
            parts += ["--compilation-config", json.dumps(value)]
        elif key != "model":
            parts += _flag(key, value)
    return shlex.join(parts)


_STORE_USERS = ("vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor")


@contextlib.contextmanager
def private_dist_store() -> Iterator[None]:
    """While the engine starts, its file-store rendezvous (`vllm_dist_<uuid>`, which vLLM puts in the
    temp dir and nothing removes: torch unlinks it only in a destructor an exiting run never reaches)
    goes into a scratch folder of this run, removed with the backends. A spawned engine process (TP > 1)
    makes its own and is not covered."""
    import importlib

    where = scratch.folder("lora-parity-vllm-")
    attr, patched = "get_file_store_init_method", []
    for name in _STORE_USERS:
        module = sys.modules.get(name) or importlib.import_module(name)
        if hasattr(module, attr):
            patched.append((module, getattr(module, attr)))
            setattr(module, attr, lambda: f"file://{where}/vllm_dist_{uuid.uuid4().hex}")
    try:
        yield
    finally:
        for module, original in patched:
            setattr(module, attr, original)


def packing(cfg: ModelConfig, model_dir: Path, invariant: bool) -> int:
    """Tokens of requests per generate call: `scoring.pack_tokens` where the kernels are batch-invariant
    on CUDA (`invariant`) and the model routes no experts (config.json), else 0 (`scoring.batch_size`)."""
    if not invariant:
        return 0
    try:
        config = safe_read.read_json(Path(model_dir) / "config.json")
    except LoraParityError:  # the engine's own start reports an unreadable checkpoint
        return 0
    return 0 if not isinstance(config, dict) or routes_experts(config) else cfg.scoring.pack_tokens


def prefix_caching(cfg: ModelConfig) -> bool:
    """Prefix caching on: the user's engine argument, else the config's."""
    return cfg.sampler.engine_args.get("enable_prefix_caching", cfg.sampler.enable_prefix_caching) is True


def prompt_row(seq: list[int], result: Any, s: int) -> list[float]:
    """Sequence `s`'s scores from its request's `prompt_logprobs` (entry 0, None, dropped: the alignment rule)."""
    plp = result.prompt_logprobs
    if plp is None or len(plp) != len(seq) or plp[0] is not None:
        got = "None" if plp is None else f"{len(plp)} entries"
        raise ScoreError(f"vLLM prompt_logprobs for sequence {s}: expected {len(seq)} entries starting with None, "
                         f"got {got}")
    return [plp[t][seq[t]].logprob for t in range(1, len(seq))]


def checkpoint_config(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's config.json (bounded read; the engine already loaded it)."""
    config = safe_read.read_json(Path(model_dir) / "config.json")
    return config if isinstance(config, dict) else {}
