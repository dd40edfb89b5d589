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
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType

import torch

MODULES = ("vllm.model_executor.layers.batch_invariant", "vllm.model_executor.determinism.batch_invariant")
"""Where vLLM keeps its batch-invariant mode (the first: vLLM 0.26; the second: later releases)."""


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
