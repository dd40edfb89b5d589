"""The local checkpoint a run loads: where it is, and what its config.json says (read once).

A config's checkpoint is its `path`, or its hub id's snapshot in the local Hugging Face cache;
lora-parity never downloads. Pure: no torch, no network.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_parity.models.config import ModelConfig
from lora_parity.models.hub import hub_cache_dirs, hub_checkpoint
from lora_parity.util import safe_read
from lora_parity.util.errors import ConfigError


def local_folder(cfg: ModelConfig) -> Path | None:
    """The config's checkpoint folder: its path, its hub id's snapshot in the local HF cache, or a
    registry package's GGUF converted (built and cached on first use)."""
    if cfg.model.gguf is not None:
        from lora_parity.models import synthetic

        return synthetic.materialize(cfg)
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    if cfg.model.hf_id is not None:
        return hub_checkpoint(cfg.model.hf_id)
    return None


def _weights_problem(folder: Path) -> str | None:
    if not (folder / "config.json").is_file():
        return f"{folder}: not an HF checkpoint folder (no config.json)"
    weights = sorted(folder.glob("*.safetensors"))
    headers: dict[str, Any] = {}
    for path in weights:  # headers only: a malformed one is named now, not after the engine started
        try:
            headers.update(safe_read.safetensors_header(path))
        except ConfigError as e:
            return str(e)
    if weights:
        return _dimensions_problem(folder, headers)
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    found = f" (found {', '.join(pickled[:3])})" if pickled else ""
    return f"{folder}: no .safetensors weights{found}; lora-parity never loads pickled weights"


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _dimensions_problem(folder: Path, headers: dict[str, Any]) -> str | None:
    """Where config.json's sizes are not the weights' (huge dimensions beside small weights would build a model of
    gigabytes before anything failed): the embedding's [vocab_size, hidden_size] and the number of layers."""
    try:
        hf = json.loads(safe_read.read_text(folder / "config.json"))
    except (ConfigError, ValueError):
        return f"{folder}: config.json is not a readable JSON object"
    hf = hf.get("text_config", hf) if isinstance(hf, dict) else None
    if not isinstance(hf, dict):
        return f"{folder}: config.json is not a JSON object"
    embed = next((e for n, e in headers.items() if n.endswith("embed_tokens.weight") and isinstance(e, dict)), None)
    vocab, hidden = hf.get("vocab_size"), hf.get("hidden_size")
    shape = embed.get("shape") if embed is not None else None
    if isinstance(vocab, int) and isinstance(hidden, int) and isinstance(shape, list) and len(shape) == 2 \
            and (shape[1] != hidden or shape[0] < vocab):  # more rows than the vocabulary: padding, fine
        return (f"{folder}: config.json says vocab_size {vocab} and hidden_size {hidden}, but the embedding "
                f"weights are {shape}")
    layers = {int(m.group(1)) for n in headers if (m := _LAYER.search(n))}
    count = hf.get("num_hidden_layers")
    if layers and isinstance(count, int) and count > max(layers) + 1:  # more in the weights: MTP layers, fine
        return f"{folder}: config.json says num_hidden_layers {count}, but the weights hold {max(layers) + 1}"
    return None


def _hub_snapshots(hf_id: str) -> list[Path]:
    repo = "models--" + hf_id.replace("/", "--")
    return [s for root in hub_cache_dirs() if (root / repo / "snapshots").is_dir()
            for s in sorted((root / repo / "snapshots").iterdir()) if s.is_dir()]


def hub_problem(hf_id: str) -> str | None:
    """Why hub model `hf_id` has no usable snapshot in the local cache (pickled weights only), or None."""
    problems = [p for p in (_weights_problem(s) for s in _hub_snapshots(hf_id)) if p]
    return problems[0] if problems else None


def require_safetensors(cfg: ModelConfig) -> None:
    """Preflight: a config's local checkpoint (its `path`, or its hub id's cached snapshot) holds
    config.json and safetensors weights; `ConfigError` naming the pickled files otherwise. Synthetic
    and GGUF models are built as safetensors, so they pass."""
    if cfg.model.path is not None:
        folder = Path(cfg.model.path)
        if not folder.is_dir():
            raise ConfigError(f"{cfg.name}: model path {folder} not found")
        problem = _weights_problem(folder)
        if problem is not None:
            raise ConfigError(problem)
    elif cfg.model.hf_id is not None and hub_checkpoint(cfg.model.hf_id) is None:
        problem = hub_problem(cfg.model.hf_id)
        if problem is not None:
            raise ConfigError(problem)


def weights_digest(folder: Path) -> str:
    """sha256 over the checkpoint's safetensors files, in name order."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:  # the sha256 of nothing would name no weights at all
        raise ConfigError(f"{folder}: no .safetensors weights to digest")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with safe_read.open_regular(f) as fh:  # never /dev/zero: it would be hashed forever
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder and its config.json, read once."""

    folder: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, folder: Path) -> Checkpoint:
        """Read `folder`/config.json; a missing or malformed one gives an empty config, one that is not a
        regular file of at most `safe_read.MAX_CONFIG_BYTES` a `ConfigError`."""
        path = Path(folder) / "config.json"
        config: Any = {}
        if path.exists():
            text = safe_read.read_text(path)  # a device, a FIFO or a huge file is refused, not read
            try:
                config = safe_read.loads(text)
            except (ValueError, RecursionError):
                config = {}
        return cls(Path(folder), config if isinstance(config, dict) else {})

    @property
    def architecture(self) -> str | None:
        """The first HF architecture class named in config.json, or None."""
        archs = self.config.get("architectures") or []
        return archs[0] if archs else None

    @property
    def vocab_size(self) -> int:
        """config.json's vocab_size; `ConfigError` if it has none that is valid."""
        vocab = self.config.get("vocab_size")
        if not isinstance(vocab, int) or vocab < 2:
            raise ConfigError(f"{self.folder}/config.json: no valid vocab_size")
        return vocab


def vocab_size(cfg: ModelConfig) -> int:
    """The vocabulary probes are drawn from: the synthetic spec's, or the local checkpoint's."""
    if cfg.model.synthetic:
        return cfg.model.synthetic.vocab_size
    folder = local_folder(cfg)
    if folder is None:
        raise ConfigError(f"{cfg.name}: no local checkpoint to run (hub models are not downloaded)")
    return Checkpoint.open(folder).vocab_size


def bos_token(cfg: ModelConfig) -> int | None:
    """The id random probes start with: config.json's `bos_token_id` of a real checkpoint, where it names
    one inside the vocabulary; None for a synthetic model (random weights: no token is special) and a
    checkpoint without one. A sequence of random ids without it puts a rare token where every real input
    has BOS, and a model whose first position gathers attention (SmolLM2) then scores the next tokens with
    bf16 errors of several nats that no real input shows (docs/verdicts.md, "Random probes")."""
    if cfg.model.synthetic:
        return None
    folder = local_folder(cfg)
    if folder is None:
        return None
    checkpoint = Checkpoint.open(folder)
    bos = checkpoint.config.get("bos_token_id")
    return bos if isinstance(bos, int) and not isinstance(bos, bool) and 0 <= bos < checkpoint.vocab_size else None


def preflight_hf_config(cfg: ModelConfig) -> dict[str, Any] | None:
    """The checkpoint's config.json before anything is loaded or generated: a synthetic spec's own
    fields, a local folder's file, or None where it is not known yet (a GGUF built on first use, a hub
    model not in the cache)."""
    spec = cfg.model.synthetic
    if spec is not None:
        from lora_parity.models.synthetic import hf_config_fields

        return hf_config_fields(spec)
    folder = Path(cfg.model.path) if cfg.model.path else hub_checkpoint(cfg.model.hf_id) if cfg.model.hf_id else None
    return Checkpoint.open(folder).config if folder is not None else None
