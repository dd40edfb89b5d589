"""The local Hugging Face hub cache, read without huggingface_hub and without the network: where a hub
model's snapshot is. Below both the checkpoint reader (`checkpoint`) and the builders (`synthetic`).
"""

from __future__ import annotations

import os
from pathlib import Path

from lora_parity.util import safe_read


def hub_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub cache may be: HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def hub_checkpoint(hf_id: str) -> Path | None:
    """The local snapshot folder of hub model `hf_id` (config.json + safetensors), or None.

    Reads the hub cache layout (`models--ORG--NAME/refs/main` -> `snapshots/REV`) without importing
    huggingface_hub and without any network access; lora-parity never downloads weights.
    """
    repo = "models--" + hf_id.replace("/", "--")
    for root in hub_cache_dirs():
        base = root / repo
        snapshots = base / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = base / "refs" / "main"
        candidates = []
        if ref.is_file():
            candidates.append(snapshots / safe_read.read_text(ref, 4096).strip())
        candidates += sorted(p for p in snapshots.iterdir() if p.is_dir())
        for snap in candidates:
            if (snap / "config.json").is_file() and any(snap.glob("*.safetensors")):
                return snap
    return None
