"""`native_autograd_ops`: vLLM's batch-invariant overrides (kernels outside autograd) lifted for a
backward pass and installed again after. A stand-in for vLLM's module registers the same kind of
override for real, on the CPU dispatch key."""

import sys
import types
import warnings
from collections.abc import Iterator

import pytest
import torch

from lora_parity.backends.native_ops import MODULES, native_autograd_ops

pytestmark = pytest.mark.unit


def _softmax_outside_autograd(input: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    x = input.detach()  # as a Triton kernel: no autograd history
    e = (x - x.amax(dim, keepdim=True)).exp()
    return e / e.sum(dim, keepdim=True)


def _bmm_outside_autograd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch._C._VariableFunctions.bmm(a.detach(), b.detach())


@pytest.fixture
def vllm_mode() -> Iterator[types.ModuleType]:
    """A module shaped like vLLM 0.26's `batch_invariant`, with the mode switched on."""
    module = types.ModuleType(MODULES[0])
    module._batch_invariant_MODE = False  # type: ignore[attr-defined]
    module._batch_invariant_LIB = None  # type: ignore[attr-defined]

    def enable() -> None:
        if module._batch_invariant_MODE:  # type: ignore[attr-defined]
            return
        module._batch_invariant_MODE = True  # type: ignore[attr-defined]
        module._batch_invariant_LIB = torch.library.Library("aten", "IMPL")  # type: ignore[attr-defined]
        module._batch_invariant_LIB.impl("aten::softmax.int", _softmax_outside_autograd, "CPU")  # type: ignore[attr-defined]
        torch.bmm = _bmm_outside_autograd

    module.enable_batch_invariant_mode = enable  # type: ignore[attr-defined]
    original_bmm = torch.bmm
    sys.modules[MODULES[0]] = module
    enable()
    try:
        yield module
    finally:
        del sys.modules[MODULES[0]]
        if module._batch_invariant_LIB is not None:  # type: ignore[attr-defined]
            module._batch_invariant_LIB._destroy()  # type: ignore[attr-defined]
        torch.bmm = original_bmm


def _grads() -> tuple[bool, bool]:
    """Whether a tensor before softmax, and one before bmm, get a gradient (u keeps a path that has one)."""
    a, w, u = (torch.randn(2, 3, 3, requires_grad=True) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about backprop through a kernel without autograd
        (torch.softmax(a, -1) + torch.bmm(w, torch.ones(2, 3, 3)) + u).pow(2).sum().backward()
    return a.grad is not None, w.grad is not None


def test_the_overrides_break_the_gradient_and_the_block_restores_it(vllm_mode: types.ModuleType) -> None:
    assert _grads() == (False, False)  # what megatron's attention met on the H200
    with native_autograd_ops() as lifted:
        assert lifted and _grads() == (True, True)
    assert vllm_mode._batch_invariant_MODE and torch.bmm is _bmm_outside_autograd  # type: ignore[attr-defined]
    assert _grads() == (False, False)  # the sampler's next scoring gets its kernels back


def test_without_vllm_or_with_the_mode_off_nothing_changes(vllm_mode: types.ModuleType) -> None:
    vllm_mode._batch_invariant_MODE = False  # type: ignore[attr-defined]
    with native_autograd_ops() as lifted:
        assert not lifted and torch.bmm is _bmm_outside_autograd
    del sys.modules[MODULES[0]]
    with native_autograd_ops() as lifted:
        assert not lifted
    sys.modules[MODULES[0]] = vllm_mode
