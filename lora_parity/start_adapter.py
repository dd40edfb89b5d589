"""`--adapter PATH`: a user's PEFT adapter both sides start from, instead of zero-init.

The folder must hold adapter_config.json and adapter_model.safetensors (never a pickle). Its
rank, alpha and target modules replace the config's `adapter`; a LoRA variant the backends would
compute differently (DoRA, rsLoRA, bias, modules_to_save, per-module ranks) is refused with one
line. See docs/probes-and-adapters.md.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from lora_parity import adapter_files as af
from lora_parity.backends.base import StartAdapterTrainer
from lora_parity.config import ModelConfig
from lora_parity.errors import ConfigError
from lora_parity.receipt import StartAdapter

_UNSUPPORTED = {"use_dora": "DoRA", "use_rslora": "rsLoRA", "lora_bias": "LoRA-bias",
                "layers_to_transform": "layers_to_transform (some layers only)"}


def read_config(folder: Path) -> dict[str, Any]:
    """The adapter's adapter_config.json, after checking the folder holds a safetensors PEFT LoRA."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"--adapter {folder}: not a folder")
    if not (folder / af.WEIGHTS_FILE).is_file():
        pickled = (folder / "adapter_model.bin").is_file()
        raise ConfigError(f"--adapter {folder}: no {af.WEIGHTS_FILE}" +
                          (" (adapter_model.bin is a pickle: lora-parity loads safetensors only)" if pickled else ""))
    try:
        config = json.loads((folder / af.CONFIG_FILE).read_text(encoding="utf-8"))
    except OSError:
        raise ConfigError(f"--adapter {folder}: no readable {af.CONFIG_FILE}") from None
    except ValueError as e:
        raise ConfigError(f"--adapter {folder}: {af.CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"--adapter {folder}: not a LoRA adapter (peft_type {config.get('peft_type')!r})"
                          if isinstance(config, dict) else f"--adapter {folder}: {af.CONFIG_FILE} is not an object")
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
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"--adapter {folder}: target_modules must be a list of module names, not {targets!r}")


def digest(folder: Path) -> str:
    """sha256 over the adapter's two files, each as its name, its size and its bytes (read in chunks)."""
    h = hashlib.sha256()
    for name in (af.CONFIG_FILE, af.WEIGHTS_FILE):
        path = Path(folder) / name
        h.update(f"{name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def record(folder: Path | None) -> StartAdapter | None:
    """What the receipt says of the start adapter: its folder's name, its digest and the base model its
    config names (None without `--adapter`)."""
    if folder is None:
        return None
    base = read_config(folder).get("base_model_name_or_path")
    return StartAdapter(name=Path(folder).name, sha256=digest(folder),
                        base_model=base if isinstance(base, str) else None)


def apply(cfg: ModelConfig, folder: Path | None) -> ModelConfig:
    """`cfg` with the adapter's rank, alpha and targets (`cfg` itself without an adapter)."""
    if folder is None:
        return cfg
    config = read_config(folder)
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"--adapter {folder}: adapter_config.json needs numeric r and lora_alpha") from None
    adapter = cfg.adapter.model_copy(update={"rank": rank, "alpha": alpha,
                                             "targets": sorted(config["target_modules"])})
    return cfg.model_copy(update={"adapter": adapter})


def check_for_trainer(folder: Path | None, trainer: str, cfg: ModelConfig) -> None:
    """Before any backend import: what the named trainer's import of the adapter cannot take (the
    megatron trainer: targets outside its layout, tensors that are not a LoRA on every layer of them)."""
    if folder is None or trainer != "megatron":
        return
    from lora_parity.backends.megatron.blocks import check_adapter
    from lora_parity.checkpoint import preflight_hf_config

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
