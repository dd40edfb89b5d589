"""What megatron-core needs to run without CUDA (gloo on the CPU), in one place, each with its reason.

megatron-core is written for GPUs. Its local layer spec (no Transformer Engine) runs on the CPU
with the workarounds below; on a CUDA machine none of them is applied except where noted.

1. Import: `import megatron.core`, and building the local spec, warn that Transformer Engine and
   Apex are missing; the local spec uses neither, so the warnings are silenced. (0.17 and later
   also import triton through `transformer/moe/ops/paged_stash.py`; 0.16.x, which the `megatron`
   extra pins, imports without triton: checked by blocking triton at import.)
2. RNG tracker: `model_parallel_cuda_manual_seed` asserts CUDA. Nothing here draws random numbers
   through Megatron (dropout is 0, weights are loaded), so the inference tracker, whose `fork` is
   a no-op, is installed instead (on CUDA too: there is nothing to seed).
3. Device: rotary embeddings, the attention buffers and the tensor-parallel gather buffers are
   allocated on `torch.cuda.current_device()`; on the CPU it must answer the CPU.
4. Causal mask: `get_default_causal_mask()` builds its mask on "cuda", so an explicit mask is passed.
5. Tensor parallel logits come back sharded on the vocabulary; `score` asks for them gathered
   (`runtime_gather_output=True`), which also runs through (3).
6. Processes: several CPU ranks on one host share its cores (threads per rank = cores / ranks),
   and gloo picks its network interface from the host name, which in containers may not route
   to itself: ranks spawned on one host use the loopback interface.
7. MoE router without Transformer Engine (CPU or CUDA): megatron-core 0.16.1's router gating
   (`moe_utils.RouterGatingLinearFunction`) tests `te_general_gemm is not None`, a name bound only
   when Transformer Engine imports; without it the first MoE forward raises NameError. The name is
   bound to None, which takes the function's own torch.mm branch.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Megatron's warnings that Transformer Engine and Apex are missing (at import and when the local
    spec is built), silenced: the local spec uses neither (1). Also two deprecation notices about
    megatron's own defaults and calls, which say nothing about the numbers."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex)")
        warnings.filterwarnings("ignore", message="full scope is deprecated")  # a default of the config
        # Megatron's tensor-parallel gather still calls the older name of torch's all-gather.
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
        yield


def import_megatron() -> Any:
    """`megatron.core` and the GPT model modules, imported quietly (1); the MoE router's gating runs
    without Transformer Engine (7)."""
    with quiet():
        import megatron.core
        import megatron.core.models.gpt  # every module the local spec uses
        from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # (7)
    return megatron.core


def install_rng_tracker() -> None:
    """The inference RNG tracker: a no-op `fork`, no CUDA RNG state (2)."""
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


@contextlib.contextmanager
def cpu_current_device() -> Iterator[None]:
    """On a machine without CUDA, `torch.cuda.current_device()` answers "cpu" inside this block (3).

    Scoped, not global: the vLLM sampler may share the process."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = original


def causal_mask(num_tokens: int, device: torch.device) -> torch.Tensor:
    """[1, 1, n, n] bool mask, True where attention is not allowed (4)."""
    return torch.triu(torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device), diagonal=1)[None, None]


def rank_environment(world_size: int) -> dict[str, str]:
    """Environment for CPU ranks spawned on this host (6); values the user set win."""
    if torch.cuda.is_available():
        return {}
    cores = len(os.sched_getaffinity(0))
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(max(1, cores // world_size))}
    return {k: v for k, v in env.items() if k not in os.environ}
