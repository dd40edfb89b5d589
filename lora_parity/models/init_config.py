"""`lora-parity init FOLDER`: a commented config YAML for a local HF checkpoint folder, to start from.

The settings are exactly those `run --model FOLDER` uses (`config._from_checkpoint`: the one source of
truth): the budget profile of the weights' dtype (fp32, else bf16), a calibrated perturbation (std
auto), LoRA on the projections the safetensors headers name (`lora_targets`), the embedded default's
rank, alpha and probes. This module only writes them out, each field with a comment; `run --model
FILE` on the result runs with the same config as the folder by path (modulo name and description).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from lora_parity.evidence.receipt_io import one_line
from lora_parity.models import config
from lora_parity.models.lora_targets import projection_targets, tensor_names
from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError

__all__ = ["config_yaml", "projection_targets", "tensor_names"]

_SECTIONS = {
    "model": "The checkpoint folder: config.json + safetensors (pickled weights are never loaded).",
    "adapter": "The LoRA adapter, the same on the trainer and the sampler (scale alpha / rank).",
    "perturbation": "The trainer-only update of the LoRA B tensors that B and C look for.",
    "probes": "Probe sequences: a sequence of n tokens has n - 1 scored positions; one seed per probe set "
              "(--probes NAME).",
    "budgets": "The budget profile of the weights' dtype (configs/budgets/; docs/verdicts.md says where the "
               "numbers come from), as `run --model FOLDER` uses it.",
    "sampler": "vLLM engine settings; max_model_len must hold the longest probe.",
    "scoring": "How sequences are grouped into forwards and requests.",
}
_FIELDS = {
    ("model", "path"): "The checkpoint folder.",
    ("model", "dtype"): "The weights' dtype, from config.json; the budgets below follow it.",
    ("model", "trust_remote_code"): "Off: the checkpoint's own Python code (custom modeling files) is never run.",
    ("adapter", "rank"): "LoRA rank.",
    ("adapter", "alpha"): "LoRA alpha.",
    ("adapter", "targets"): "Modules LoRA goes on: the projections the checkpoint's weights name.",
    ("probes", "lengths"): "Lengths of the random (or text) probe sequences.",
    ("probes", "seeds"): "One seed per probe set.",
    ("perturbation", "std"): "Std of the seeded noise added to every LoRA B tensor; 'auto': calibrated on the "
                             "trainer alone at the start of each run (docs/verdicts.md); a number fixes it.",
    ("perturbation", "stimulus_factor"): "std auto: the trainer's change must be at least this many times A's "
                                         "mean disagreement.",
}
_TOP = {"per_target": "Per-target coverage after C: each target perturbed alone, synced and compared."}


def _v(value: Any) -> str:
    """A YAML value (JSON is YAML)."""
    return json.dumps(value)


def _comment(text: str | None, indent: str) -> list[str]:
    if not text:
        return []
    return textwrap.wrap(" ".join(text.split()), 100, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ")


def _section(name: str, spec: BaseModel, notes: list[str]) -> list[str]:
    lines = [*_comment(_SECTIONS.get(name), ""), f"{name}:"]
    values = spec.model_dump(mode="json")
    for key, field in type(spec).model_fields.items():
        if values[key] is None or ((name, key) == ("adapter", "target_parameters") and not values[key]):
            continue  # unset; and expert LoRA only where asked for (Qwen3-MoE's fused experts, docs/moe.md)
        lines += _comment(_FIELDS.get((name, key)) or field.description, "  ")
        if (name, key) == ("adapter", "targets"):
            lines += [f"  # Left out: {n}." for n in notes]
        lines.append(f"  {key}: {_v(values[key])}")
    return lines


def config_yaml(folder: Path) -> str:
    """The commented config YAML for checkpoint `folder`: `config._from_checkpoint(folder)` written out."""
    cfg = config._from_checkpoint(folder)
    targets, notes = projection_targets(tensor_names(folder))
    if not targets:
        raise ConfigError(f"{folder}: no *proj* Linear weights found for LoRA; write adapter.targets yourself")
    hf = safe_read.read_json(folder / "config.json")
    # Text from config.json goes into comments on one line each: a newline in it would start a YAML key.
    archs = hf.get("architectures") if isinstance(hf, dict) else None
    arch = one_line(", ".join(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else "", 200)
    arch = arch or "unknown architecture"
    model_type = one_line(str(hf.get("model_type", "unknown")) if isinstance(hf, dict) else "unknown", 200)
    name = folder.resolve().name
    lines = [
        f"# lora-parity config for the checkpoint folder {one_line(name, 200)}",
        f"# ({arch}, model_type {model_type}), written by `lora-parity init`: the settings",
        "# `lora-parity run --model FOLDER` uses. Check it, then: lora-parity run --model THIS_FILE. Field",
        "# reference: README, and the pydantic models in lora_parity/models/config.py (every field has a docstring).",
        f"name: {_v(name)}",
        f"description: {_v(f'local checkpoint {name} ({arch}), {cfg.model.dtype}, LoRA r{cfg.adapter.rank}')}",
    ]
    for key, field in config.ModelConfig.model_fields.items():
        value = getattr(cfg, key)
        if key in ("name", "description") or value is None:
            continue
        if isinstance(value, BaseModel):
            lines += _section(key, value, notes)
        else:
            lines += [*_comment(_TOP.get(key) or field.description, ""), f"{key}: {_v(value)}"]
    return "\n".join(lines) + "\n"
