"""`native_autograd_ops`: vLLM's batch-invariant overrides (kernels outside autograd) lifted for a
backward pass and installed again after. A stand-in for vLLM's module registers the same kind of
override for real, on the CPU dispatch key."""

import os
import sys
import warnings
from typing import Any

import pytest
import torch

from lora_parity.backends import native_ops
from lora_parity.backends.native_ops import MODULES, native_autograd_ops

from .conftest import bmm_outside_autograd, vllm_mode_on

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


def _flags() -> tuple[Any, ...]:
    """The reduced-precision flags and the cuBLAS workspace variables."""
    matmul = torch.backends.cuda.matmul
    return (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction,
            *(os.environ.get(name) for name in native_ops.WORKSPACES))


PLAIN, ENGINE = (True, True, None, None), (False, False, ":16:8", "1")


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The settings kept before the mode goes on (reset per test), and a stand-in for the preferred BLAS library
    (the CPU build refuses cuBLASLt): what each call set."""
    monkeypatch.setattr(native_ops, "_plain", None)
    for name in native_ops.WORKSPACES:
        monkeypatch.delenv(name, raising=False)
    chosen: list[Any] = ["cublas"]

    def preferred(backend: Any = None) -> Any:
        if backend is not None:
            chosen.append(backend)
        return chosen[-1]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    return chosen


def test_plain_kernels_put_back_the_settings_kept_before_the_engine(kept: list[Any]) -> None:
    native_ops.keep_plain_settings()  # before the engine: PyTorch's defaults
    assert _flags() == PLAIN
    with vllm_mode_on() as module:
        torch.backends.cuda.preferred_blas_library("cublaslt")  # as vLLM's mode on Hopper
        native_ops.keep_plain_settings()  # a second sampler, the mode on: the first settings stay
        assert _flags() == ENGINE and _grads() == (False, False)
        with native_ops.plain_kernels() as changed:
            assert changed and _flags() == PLAIN and _grads() == (True, True)
            assert torch.backends.cuda.preferred_blas_library() == "cublas"
        # the engine's settings and kernels back for the sampler's next scoring
        assert _flags() == ENGINE and _grads() == (False, False) and module._batch_invariant_MODE
        assert torch.backends.cuda.preferred_blas_library() == "cublaslt"


def test_plain_kernels_without_kept_settings_lift_the_kernels_only(kept: list[Any]) -> None:
    with vllm_mode_on():
        with native_ops.plain_kernels() as changed:
            assert changed and _grads() == (True, True) and _flags() == ENGINE
    with native_ops.plain_kernels() as changed:  # no vLLM: nothing to change
        assert not changed and kept == ["cublas"]


def test_the_trainers_scoring_runs_in_plain_kernels(kept: list[Any]) -> None:
    """`hf.score_sequences` (the trainer's and the fp32 references' forwards) sees the kept settings; the scores
    are those of the same forward without the engine's mode."""
    from lora_parity.backends.hf import score_sequences

    seen: list[tuple[Any, ...]] = []

    class Model(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
            seen.append(_flags())
            logits = torch.nn.functional.one_hot(input_ids, 8).float() * 3
            return type("Out", (), {"logits": logits})()

    native_ops.keep_plain_settings()
    plain = score_sequences(Model(), [[1, 2, 3], [4, 5]], torch.device("cpu"))
    with vllm_mode_on():
        assert score_sequences(Model(), [[1, 2, 3], [4, 5]], torch.device("cpu")) == plain
        assert _flags() == ENGINE
    assert seen == [PLAIN] * 4  # one forward per sequence, two runs


def test_the_vllm_sampler_keeps_the_settings_before_its_engine_starts(kept: list[Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.backends import vllm

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    vllm._batch_invariant_environment(True)
    assert native_ops._plain[2:] == ("cublas", None, None)
    assert {native_ops._plain[0], native_ops._plain[1]} <= {True, (True, True)}  # with split-K's part on torch 2.10+


def test_the_settings_go_back_whole_split_k_included(kept: list[Any]) -> None:
    """The engine's (False, False) (no reduced precision, no split-K: vLLM's on torch 2.10+) comes back as it was,
    not as (False, True), which setting the flag's bool alone would give."""
    matmul = torch.backends.cuda.matmul
    with vllm_mode_on():
        engine = native_ops._settings()
        matmul.allow_bf16_reduced_precision_reduction = True  # (True, True)
        native_ops._put(engine)
        assert (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction_split_k) \
            == (False, False)
