"""`native_autograd_ops`: vLLM's batch-invariant overrides (kernels outside autograd) lifted for a
backward pass and installed again after. A stand-in for vLLM's module registers the same kind of
override for real, on the CPU dispatch key."""

import sys
import warnings
from typing import Any

import pytest
import torch

from lora_parity.backends.native_ops import MODULES, native_autograd_ops

from .conftest import bmm_outside_autograd

pytestmark = pytest.mark.unit


def _grads() -> tuple[bool, bool]:
    """Whether a tensor before softmax, and one before bmm, get a gradient (u keeps a path that has one)."""
    a, w, u = (torch.randn(2, 3, 3, requires_grad=True) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about backprop through a kernel without autograd
        (torch.softmax(a, -1) + torch.bmm(w, torch.ones(2, 3, 3)) + u).pow(2).sum().backward()
    return a.grad is not None, w.grad is not None


def test_the_overrides_break_the_gradient_and_the_block_restores_it(vllm_mode: Any) -> None:
    assert _grads() == (False, False)  # what megatron's attention met on the H200
    with native_autograd_ops() as lifted:
        assert lifted and _grads() == (True, True)
    assert vllm_mode._batch_invariant_MODE and torch.bmm is bmm_outside_autograd
    assert _grads() == (False, False)  # the sampler's next scoring gets its kernels back


def test_without_vllm_or_with_the_mode_off_nothing_changes(vllm_mode: Any) -> None:
    vllm_mode._batch_invariant_MODE = False
    with native_autograd_ops() as lifted:
        assert not lifted and torch.bmm is bmm_outside_autograd
    del sys.modules[MODULES[0]]
    with native_autograd_ops() as lifted:
        assert not lifted
    sys.modules[MODULES[0]] = vllm_mode
