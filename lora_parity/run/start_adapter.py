"""`--adapter PATH`: a user's PEFT adapter both sides start from, instead of zero-init.

The folder must hold adapter_config.json and adapter_model.safetensors (never a pickle). Its
rank, alpha and target modules replace the config's `adapter`; a LoRA variant the backends would
compute differently (DoRA, rsLoRA, bias, modules_to_save, per-module ranks) is refused with one
line. See docs/probes-and-adapters.md.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from lora_parity.backends.base import StartAdapterTrainer
from lora_parity.evidence.receipt import StartAdapter
from lora_parity.evidence.receipt_io import one_line
from lora_parity.models import adapter_files as af
from lora_parity.models.config import TARGET_NAME, AdapterSpec, ModelConfig
from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError

_UNSUPPORTED = {"use_dora": "DoRA", "use_rslora": "rsLoRA", "lora_bias": "LoRA-bias",
                "layers_to_transform": "layers_to_transform (some layers only)"}
_DENSE_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_ANY_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_config(folder: Path) -> dict[str, Any]:
    """The adapter's adapter_config.json, after checking the folder holds a safetensors PEFT LoRA.
    Both files are read through `safe_read`: a device or FIFO in their place is refused at once."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"--adapter {folder}: not a folder")
    if not (folder / af.WEIGHTS_FILE).exists():
        pickled = (folder / "adapter_model.bin").is_file()
        raise ConfigError(f"--adapter {folder}: no {af.WEIGHTS_FILE}" +
                          (" (adapter_model.bin is a pickle: lora-parity loads safetensors only)" if pickled else ""))
    safe_read.open_regular(folder / af.WEIGHTS_FILE).close()
    if not (folder / af.CONFIG_FILE).exists():
        raise ConfigError(f"--adapter {folder}: no readable {af.CONFIG_FILE}")
    config = safe_read.read_json(folder / af.CONFIG_FILE)
    if not isinstance(config, dict):
        raise ConfigError(f"--adapter {folder}: {af.CONFIG_FILE} is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"--adapter {folder}: not a LoRA adapter (peft_type {one_line(repr(config['peft_type']))})")
    _refuse_variants(folder, config)
    return config


def _refuse_variants(folder: Path, config: dict[str, Any]) -> None:
    for key, name in _UNSUPPORTED.items():
        if config.get(key):
            raise ConfigError(f"--adapter {folder}: {name} adapters are not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise ConfigError(f"--adapter {folder}: bias and modules_to_save are not supported (LoRA A and B only)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ConfigError(f"--adapter {folder}: per-module ranks or alphas are not supported")
    if config.get("target_parameters"):
        raise ConfigError(f"--adapter {folder}: target_parameters (expert LoRA) start adapters are not supported yet")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"--adapter {folder}: target_modules must be a list of module names, "
                          f"not {one_line(repr(targets))}")
    bad = next((t for t in targets if not TARGET_NAME.fullmatch(t)), None)
    if bad is not None:  # the names go onto `vllm serve`'s command line: never an option such as --host
        raise ConfigError(f"--adapter {folder}: target_modules: {one_line(repr(bad))} is not a module name "
                          "(letters, digits, _ and .)")


def digest(folder: Path) -> str:
    """sha256 over the adapter's two files, each as its name, its size and its bytes (read in chunks,
    regular files only: `safe_read.open_regular`)."""
    h = hashlib.sha256()
    for name in (af.CONFIG_FILE, af.WEIGHTS_FILE):
        path = Path(folder) / name
        with safe_read.open_regular(path) as f:
            h.update(f"{name}\0{os.fstat(f.fileno()).st_size}\0".encode())
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def record(folder: Path | None) -> StartAdapter | None:
    """What the receipt says of the start adapter: its folder's name, its digest and the base model its
    config names (None without `--adapter`)."""
    if folder is None:
        return None
    base = read_config(folder).get("base_model_name_or_path")
    if isinstance(base, str) and base.startswith(("/", "~")):
        base = f".../{Path(base).name}"  # a folder on the machine that made the adapter: its name only
    return StartAdapter(name=Path(folder).name, sha256=digest(folder),
                        base_model=base if isinstance(base, str) else None)


def apply(cfg: ModelConfig, folder: Path | None, model_shapes: bool = True) -> ModelConfig:
    """`cfg` with the adapter's rank, alpha and targets (`cfg` itself without an adapter), checked
    as a config's are (a positive integer rank, a finite positive alpha, module names that can go on
    a command line), and with `model_shapes` against the model's shapes (`check_for_model`)."""
    if folder is None:
        return cfg
    config = read_config(folder)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(alpha, int | float) \
            or isinstance(alpha, bool):
        raise ConfigError(f"--adapter {folder}: adapter_config.json needs an integer r and a numeric lora_alpha")
    try:
        adapter = AdapterSpec.model_validate({"rank": rank, "alpha": alpha,
                                              "targets": sorted(config["target_modules"])})
    except ValidationError as e:
        first = e.errors()[0]
        field = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules"}.get(str(first["loc"][0]), "") \
            if first.get("loc") else ""
        raise ConfigError(f"--adapter {folder}: {af.CONFIG_FILE}: {field or 'adapter'}: "
                          f"{one_line(str(first.get('msg')))}") from None
    problem = rank_problem(safe_read.safetensors_header(Path(folder) / af.WEIGHTS_FILE), adapter.rank)
    if problem is not None:  # before any model is built at that rank (r = 150000 on rank-8 tensors: gigabytes)
        raise ConfigError(f"--adapter {folder}: {af.CONFIG_FILE} says r = {adapter.rank}, but {problem}")
    if model_shapes:
        check_for_model(folder, cfg, config, adapter.rank)
    return cfg.model_copy(update={"adapter": adapter})


_LORA_TENSOR = re.compile(r".*\.lora_([AB])(?:\.\w+)?\.weight")


def rank_problem(header: dict[str, Any], rank: int) -> str | None:
    """Where a 2-D LoRA tensor's rank side (lora_A's rows, lora_B's columns; safetensors header only) is not
    `rank`: the tensor and its shape; None if every one agrees."""
    for name, entry in header.items():
        match = _LORA_TENSOR.fullmatch(name)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if match is None or not isinstance(shape, list) or len(shape) != 2:
            continue
        side = shape[0] if match.group(1) == "A" else shape[1]
        if side != rank:
            return f"its tensor {one_line(name)} has shape {shape} (rank {side})"
    return None


def _dims(hf: dict[str, Any]) -> dict[str, tuple[int, int]] | None:
    """(input, output) features of each dense projection, from config.json; None where it lacks them."""
    need = ("hidden_size", "intermediate_size", "num_attention_heads")
    if not all(isinstance(hf.get(k), int) and hf[k] > 0 for k in need):
        return None
    hidden, inter, heads = hf["hidden_size"], hf["intermediate_size"], hf["num_attention_heads"]
    kv, head_dim = hf.get("num_key_value_heads"), hf.get("head_dim")
    kv = kv if isinstance(kv, int) else heads
    head_dim = head_dim if isinstance(head_dim, int) else hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def shape_problem(header: dict[str, Any], hf: dict[str, Any], rank: int) -> str | None:
    """Why the adapter's tensors (a safetensors header) cannot be a LoRA on the model of config.json
    `hf`: a layer it does not have, a projection of another size (`rank` only completes the shape
    named); None if they fit."""
    layers = hf.get("num_hidden_layers")
    dims = _dims(hf)
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        layer = _ANY_LAYER.search(name)
        if layer and isinstance(layers, int) and int(layer.group(1)) >= layers:
            return f"it has tensors for layer {layer.group(1)}, the model {layers} layers"
        dense = _DENSE_TENSOR.fullmatch(name)
        shape = entry.get("shape")
        if dense is None or dims is None or dense.group(3) not in dims or not isinstance(shape, list) \
                or len(shape) != 2:
            continue
        kind, ab = dense.group(3), dense.group(4)
        inputs, outputs = dims[kind]
        want = [rank, inputs] if ab == "A" else [outputs, rank]
        # Only the model's side of the shape: a wrong rank is a malformed adapter, which the
        # trainer's own import refuses in its own words.
        if (shape[1] != inputs) if ab == "A" else (shape[0] != outputs):
            return f"its {kind} lora_{ab} is {shape}, the model needs {want}"
    return None


def check_for_model(folder: Path, cfg: ModelConfig, config: dict[str, Any], rank: int) -> None:
    """Before anything loads: the adapter's tensors fit the model's config.json (its layers and
    projection sizes; safetensors header only), else one line naming the adapter's base model (a
    forgotten `--model` is found in a second, not after the model has loaded)."""
    from lora_parity.models.checkpoint import preflight_hf_config

    hf = preflight_hf_config(cfg)
    if not hf:
        return
    problem = shape_problem(safe_read.safetensors_header(Path(folder) / af.WEIGHTS_FILE), hf, rank)
    if problem is None:
        return
    base = config.get("base_model_name_or_path")
    made_for = f"made for {one_line(repr(base))}" if isinstance(base, str) and base else "made for another model"
    raise ConfigError(f"--adapter {folder}: {made_for}, not {cfg.name} ({problem}); pass its base model with --model")


def check_for_trainer(folder: Path | None, trainer: str, cfg: ModelConfig) -> None:
    """Before any backend import: what the named trainer's import of the adapter cannot take (the
    megatron trainer: targets outside its layout, tensors that are not a LoRA on every layer of them)."""
    if folder is None or trainer != "megatron":
        return
    from lora_parity.backends.megatron.blocks import check_adapter
    from lora_parity.models.checkpoint import preflight_hf_config

    check_adapter(folder, cfg.adapter.targets, cfg.adapter.rank, preflight_hf_config(cfg))


def require(folder: Path | None, trainer_cls: type, trainer: str, sampler_cls: type, sampler: str) -> None:
    """Preflight, with an adapter: the trainer can start from one (its traits say why not), and the
    sampler holds its own copy of what it is published."""
    if folder is None:
        return
    why = trainer_cls.traits.start_adapter_unavailable  # type: ignore[attr-defined]
    if why is not None or not issubclass(trainer_cls, StartAdapterTrainer):
        raise ConfigError(f"--adapter: the {trainer!r} trainer cannot start from a user's adapter ({why})")
    if sampler_cls.traits.shares_trainer_state:  # type: ignore[attr-defined]
        raise ConfigError(f"--adapter: the {sampler!r} sampler serves the trainer's own state; use vllm or hf")


def load(trainer: object, folder: Path | None) -> None:
    """Start `trainer` from the adapter in `folder` (nothing without one; preflight checked the class)."""
    if folder is None:
        return
    if not isinstance(trainer, StartAdapterTrainer):
        raise ConfigError(f"{type(trainer).__name__} cannot start from a user's adapter")
    trainer.load_start_adapter(folder)
