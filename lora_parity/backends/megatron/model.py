"""The megatron-core `GPTModel` a `Shard` holds, built for a `Shape`: the local layer spec (no Transformer
Engine), dense or, for Qwen3-MoE, with megatron-core's MoE layer.

The MoE layer (tensor-parallel size 1): `TopKRouter` (`mlp.router.weight`, HF's `mlp.gate.weight`), the
"allgather" token dispatcher, `SequentialMLP` experts (`mlp.experts.local_experts.E.linear_fc1/linear_fc2`, no
grouped GEMM), no load balancing, no auxiliary loss, no capacity (no token dropped), and megatron-core's router
replay enabled (`routes`). All of it runs on the CPU (`cpu`, workaround 7).

Qwen3-MoE's routing weights map onto the router's settings exactly: HF takes the top-k of the softmax over
every expert's logit, renormalized to sum to 1 when norm_topk_prob is set. Softmax is monotone, so the top-k of
the logits is the same set (`moe_router_pre_softmax` off), and the softmax over the k chosen logits is the
chosen experts' softmax renormalized over them: norm_topk_prob true. norm_topk_prob false is
`moe_router_pre_softmax` on: the softmax over every expert, its top-k taken as they are. No top-k scaling
factor, no expert bias. The two differ only in fp32 rounding (a softmax over k logits against one over all,
then divided by its top-k sum).
"""

from __future__ import annotations

from typing import Any

import torch

from lora_parity.backends.megatron.layout import Shape


def _moe_settings(shape: Shape) -> dict[str, Any]:
    """TransformerConfig's MoE fields for `shape` (none for a dense model)."""
    if not shape.moe:
        return {}
    return {
        "num_moe_experts": shape.num_experts, "moe_router_topk": shape.top_k,
        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
        "moe_router_score_function": "softmax", "moe_router_pre_softmax": not shape.norm_topk_prob,
        "moe_router_topk_scaling_factor": None, "moe_router_enable_expert_bias": False,
        "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None,
        "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False, "moe_permute_fusion": False,
        "moe_router_fusion": False, "moe_expert_capacity_factor": None, "moe_enable_routing_replay": True,
    }


def gpt_model(shape: Shape, tp: int, dtype: torch.dtype, device: torch.device) -> Any:
    """The GPTModel for `shape` at tensor-parallel size `tp`, its parameters in `dtype` on `device` (contents
    uninitialised: the checkpoint is loaded into them)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = shape
    config = TransformerConfig(
        num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
        num_attention_heads=s.num_heads, num_query_groups=s.num_groups, kv_channels=s.head_dim,
        normalization="RMSNorm", layernorm_epsilon=s.norm_eps, qk_layernorm=s.qk_norm,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0,  # defaults are 0.1
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        bias_dropout_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        **_moe_settings(s),
    )
    spec = get_gpt_layer_local_spec(num_experts=s.num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=s.qk_norm, normalization="RMSNorm")
    return GPTModel(
        config, spec,
        vocab_size=s.vocab_size, max_sequence_length=s.max_positions, position_embedding_type="rope",
        rotary_base=s.rope_theta,  # type: ignore[arg-type,unused-ignore]  # a float works; hinted int
        share_embeddings_and_output_weights=s.tied_embeddings, parallel_output=True,
    ).to(device)
