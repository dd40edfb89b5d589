"""Deterministic synthetic checkpoints in HF format, generated on first use and cached.

No weights can be downloaded in CI, so the embedded default is a small Qwen3-architecture model
made from a seed: HF's own initialisation under `torch.manual_seed`, then the output projection
redrawn with a larger std so that next-token distributions are far from uniform. It is saved
with `save_pretrained` (config.json + model.safetensors) and loaded back through the same code
paths as a real checkpoint. The cache key is the digest of the spec, so a changed spec makes a
new folder; generation writes to a temporary folder and renames it into place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from lora_parity.config import ModelConfig, SyntheticSpec
from lora_parity.errors import ConfigError
from lora_parity.receipt import sha256_json


def cache_root() -> Path:
    """`LORA_PARITY_CACHE`, else ~/.cache/lora-parity."""
    env = os.environ.get("LORA_PARITY_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lora-parity"


def spec_digest(spec: SyntheticSpec, dtype: str) -> str:
    """Cache key of a synthetic checkpoint."""
    return sha256_json({"spec": spec.model_dump(mode="json"), "dtype": dtype, "generator": 1})[:16]


def generate(spec: SyntheticSpec, dtype: str, folder: Path) -> None:
    """Write the checkpoint of `spec` into `folder` (created)."""
    import torch
    import transformers

    config_cls = getattr(transformers, spec.architecture.replace("ForCausalLM", "Config"))
    hf_config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    device = torch.device(spec.generate_on)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{spec.architecture} spec is generated on the GPU (generate_on: cuda); no CUDA here")
    torch.manual_seed(spec.seed)
    with device:
        model = getattr(transformers, spec.architecture)(hf_config).to(getattr(torch, dtype))
        with torch.no_grad():
            generator = torch.Generator(device=device).manual_seed(spec.seed + 1)
            head = model.get_output_embeddings().weight
            head.copy_(torch.randn(head.shape, generator=generator, dtype=torch.float32) * spec.lm_head_std)
    model.save_pretrained(folder, safe_serialization=True)


def materialize(cfg: ModelConfig) -> Path:
    """The checkpoint folder of a config: generated and cached for a synthetic model, the given
    folder for a local one."""
    spec = cfg.model
    if spec.path is not None:
        path = Path(spec.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model path {path} not found or has no config.json")
        return path
    if spec.hf_id is not None:
        raise ConfigError(
            f"{cfg.name} names the hub model {spec.hf_id}; lora-parity does not download weights: "
            "download it yourself and pass the folder with --model PATH"
        )
    assert spec.synthetic is not None
    folder = cache_root() / "models" / f"{cfg.name}-{spec_digest(spec.synthetic, spec.dtype)}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        generate(spec.synthetic, spec.dtype, tmp)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # lost a race to another process: theirs is identical
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def weights_digest(folder: Path) -> str:
    """sha256 over the checkpoint's safetensors files, in name order."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
