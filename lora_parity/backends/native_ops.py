"""PyTorch's own kernels back for a backward pass, in a process where vLLM's batch-invariant mode is on.

With the `vllm` sampler in the same process (the default), vLLM's batch-invariant mode (vLLM 0.26,
`model_executor.layers.batch_invariant`) registers Triton kernels for aten softmax, _softmax,
_log_softmax, mean.dim and bmm at the CUDA dispatch key and replaces `torch.bmm` with a Python function.
Forward passes still work, but `torch.bmm` then records no autograd history, and `aten::softmax.int`
(a composite op) loses its autograd kernel: megatron-core's local attention (`torch.bmm`,
`torch.nn.Softmax`) passes no gradient to what comes before it, so the LoRA of `linear_qkv` got none
(seen on the H200: every `--trainer megatron --update step` run stopped at its first step). HF's
attention (scaled_dot_product_attention) is not affected.

`native_autograd_ops()` undoes the overrides for the duration of a block and installs them again after,
so the sampler's next scoring is batch-invariant as before. Without vLLM loaded, or with the mode
off, it does nothing.

`plain_kernels()` goes further, for the trainer's scoring forwards (`hf.score_sequences`): it also puts back the
matmul flags the mode turns off (cuBLAS's reduced-precision reductions, the preferred BLAS library) and the cuBLAS
workspace variables it sets (`CUBLAS_WORKSPACE_CONFIG=:16:8`, `CUBLASLT_WORKSPACE_SIZE=1`: no split-K), which PyTorch
reads as it calls cuBLAS, to what they were before the engine started (`keep_plain_settings`). On an H100 a
SmolLM2-135M trainer forward (LoRA on seven projections) took 50.8 ms before the mode, 122.1 ms with it and 46.9 ms
inside (`benchmarks/gpu-trainer-forward-plain-kernels-055b39a-h100.txt`): the workspace variables and the kernels
were the cost, not the flags. Inside is close to a trainer in its own process (as beside an engine over HTTP), not
equal bit for bit (max 0.016 there): something of the mode stays that this does not put back.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

MODULES = ("vllm.model_executor.layers.batch_invariant", "vllm.model_executor.determinism.batch_invariant")
"""Where vLLM keeps its batch-invariant mode (the first: vLLM 0.26; the second: later releases)."""


WORKSPACES = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
"""The cuBLAS workspace sizes the mode sets on Hopper (no split-K); PyTorch reads them as it calls cuBLAS."""

_plain: tuple[Any, ...] | None = None
"""The settings before the engine turned the mode on: bf16's and fp16's reduced-precision reductions, the
preferred BLAS library, then the workspace variables (None: unset) (`keep_plain_settings`)."""


def _reduction(dtype: str) -> Any:
    """A reduced-precision flag as the setter takes it back: with its split-K part where torch has one (2.10+)."""
    matmul = torch.backends.cuda.matmul
    allowed = getattr(matmul, f"allow_{dtype}_reduced_precision_reduction")
    split_k = getattr(matmul, f"allow_{dtype}_reduced_precision_reduction_split_k", None)
    return allowed if split_k is None else (allowed, split_k)


def _settings() -> tuple[Any, ...]:
    return (_reduction("bf16"), _reduction("fp16"), torch.backends.cuda.preferred_blas_library(),
            *(os.environ.get(name) for name in WORKSPACES))


def _put(settings: tuple[Any, ...]) -> None:
    matmul = torch.backends.cuda.matmul
    matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = settings[:2]
    if torch.backends.cuda.preferred_blas_library() != settings[2]:
        torch.backends.cuda.preferred_blas_library(settings[2])
    for name, value in zip(WORKSPACES, settings[3:], strict=True):
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def keep_plain_settings() -> None:
    """Remember this process's matmul settings for `plain_kernels`; called before an engine here turns the mode on
    (a second call, once the mode is on, keeps the first)."""
    global _plain
    if _active() is None:
        _plain = _settings()


def _active() -> ModuleType | None:
    for name in MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_batch_invariant_MODE", False):
            return module
    return None


@contextlib.contextmanager
def native_autograd_ops() -> Iterator[bool]:
    """Inside: PyTorch's own `torch.bmm` and aten kernels (yields whether vLLM's overrides were lifted)."""
    module = _active()
    library = getattr(module, "_batch_invariant_LIB", None) if module is not None else None
    if module is None or library is None or not hasattr(module, "enable_batch_invariant_mode"):
        yield False
        return
    replaced_bmm = torch.bmm
    library._destroy()  # removes every kernel that Library registered
    setattr(module, "_batch_invariant_LIB", None)  # noqa: B010  (vLLM's own module state)
    setattr(module, "_batch_invariant_MODE", False)  # noqa: B010
    torch.bmm = torch._C._VariableFunctions.bmm
    try:
        yield True
    finally:
        module.enable_batch_invariant_mode()
        torch.bmm = replaced_bmm


@contextlib.contextmanager
def plain_kernels() -> Iterator[bool]:
    """Inside: PyTorch's own kernels (`native_autograd_ops`) and the matmul settings kept before the engine
    started (yields whether anything changed); the mode's settings back after, for the sampler's next scoring."""
    if _active() is None:
        yield False
        return
    engine = _settings()
    with native_autograd_ops() as lifted:
        if _plain is not None:
            _put(_plain)
        try:
            yield lifted or _plain is not None
        finally:
            _put(engine)
