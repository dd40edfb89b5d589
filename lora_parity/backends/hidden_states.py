"""Hidden states at every point of the forward, on an HF model and on the in-process vLLM model (`lora-parity
locate`, docs/locate.md), and their per-token distances.

Points, in forward order: `embed` (the embedding's output), per decoder layer I `layers.I.input_layernorm` (that
norm's output), `layers.I.self_attn` (the residual stream after attention), `layers.I.post_attention_layernorm`,
`layers.I` (the stream after the MLP), and `norm` (the final norm's output). A layer without the two norms (another
architecture) gives its output only.

vLLM's Llama/Qwen3 decoder layers return (hidden_states, residual) and fuse the residual add into the next norm
(`RMSNorm(x, residual)` returns (normed x + residual, x + residual), in place on the CPU): the stream after layer I
is hidden_states + residual, the stream after attention is post_attention_layernorm's second output. HF's layers add
the residual themselves: the stream after attention is post_attention_layernorm's input. Every capture is cloned at
once (the fused kernels overwrite their inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

States = dict[str, list[torch.Tensor]]
"""Point name -> one [tokens, hidden] tensor per sequence, on the CPU."""
PointInfo = tuple[str, int | None, str]
"""(point name, decoder layer or None, the module that computes between the previous point and it)."""


def decoder(root: Any) -> Any:
    """The decoder stack (the module with `layers`, `embed_tokens` and `norm`) under a causal LM, a PEFT model or
    vLLM's model; `ValueError` where there is none."""
    frontier = [root]
    for _ in range(5):
        for module in frontier:
            if all(hasattr(module, a) for a in ("layers", "embed_tokens", "norm")):
                return module
        frontier = [getattr(m, a) for m in frontier for a in ("base_model", "model") if hasattr(m, a)]
    raise ValueError(f"{type(root).__name__}: no decoder stack with layers, embed_tokens and norm")


def _split(layer: Any) -> bool:
    return hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm")


def points(stack: Any) -> list[PointInfo]:
    """The points of this decoder stack, in forward order."""
    out: list[PointInfo] = [("embed", None, "embedding")]
    for i, layer in enumerate(stack.layers):
        if _split(layer):
            out += [(f"layers.{i}.input_layernorm", i, "input_layernorm"),
                    (f"layers.{i}.self_attn", i, "self_attn (and its residual add)"),
                    (f"layers.{i}.post_attention_layernorm", i, "post_attention_layernorm"),
                    (f"layers.{i}", i, "mlp (and its residual add)")]
        else:
            out.append((f"layers.{i}", i, "the decoder layer"))
    return [*out, ("norm", None, "final norm")]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _keep(sink: States, name: str, value: torch.Tensor) -> None:
    sink.setdefault(name, []).append(value.detach().reshape(-1, value.shape[-1]).to("cpu", copy=True))


ROUTER = "router."
"""Key prefix in a sink of the router logits of MoE layer I (`router.I`), captured beside the points."""


@contextmanager
def hooked(stack: Any, engine: bool, sink: States, gates: Sequence[Any] = ()) -> Iterator[None]:
    """Forward hooks on `stack` that append every point's hidden state of every forward to `sink` (`engine`: vLLM's
    fused-residual layout, else HF's), and each of `gates`' router logits (`moe.Gate`: the module's output's first
    item) under `router.I`; removed on leaving."""
    handles = [g.module.register_forward_hook(
        lambda _m, args, out, name=f"{ROUTER}{g.layer}": _keep(sink, name, _first(out))) for g in gates]

    def post(name: str, pick: Callable[[Any, Any], torch.Tensor]) -> Callable[..., None]:
        return lambda _m, args, out: _keep(sink, name, pick(args, out))

    handles.append(stack.embed_tokens.register_forward_hook(post("embed", lambda a, o: _first(o))))
    for i, layer in enumerate(stack.layers):
        if _split(layer):
            handles.append(layer.input_layernorm.register_forward_hook(
                post(f"layers.{i}.input_layernorm", lambda a, o: _first(o))))
            post_norm = layer.post_attention_layernorm
            if engine:
                handles.append(post_norm.register_forward_hook(post(f"layers.{i}.self_attn", lambda a, o: o[1])))
            else:
                handles.append(post_norm.register_forward_pre_hook(
                    lambda _m, args, name=f"layers.{i}.self_attn": _keep(sink, name, args[0])))
            handles.append(post_norm.register_forward_hook(
                post(f"layers.{i}.post_attention_layernorm", lambda a, o: _first(o))))
        if engine:
            handles.append(layer.register_forward_hook(post(f"layers.{i}", lambda a, o: o[0] + o[1])))
        else:
            handles.append(layer.register_forward_hook(post(f"layers.{i}", lambda a, o: _first(o))))
    handles.append(stack.norm.register_forward_hook(post("norm", lambda a, o: _first(o))))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def joined(sink: States, num_tokens: int, what: str) -> dict[str, torch.Tensor]:
    """One sequence's states from the forwards that computed it (concatenated), each checked to hold exactly its
    `num_tokens` tokens (a sequence split into chunks of a prefill is put back together; anything else is refused)."""
    out = {}
    for name, parts in sink.items():
        whole = torch.cat(parts)
        if whole.shape[0] != num_tokens:
            raise ValueError(f"{what}: {whole.shape[0]} hidden states at {name} for a sequence of {num_tokens} tokens")
        out[name] = whole
    return out


@torch.inference_mode()
def hf_states(model: Any, sequences: Sequence[Sequence[int]], device: torch.device,
              gates: Sequence[Any] = ()) -> list[dict[str, torch.Tensor]]:
    """Every point's hidden state of each sequence (one forward per sequence, no padding), on the CPU; with
    `gates`, their router logits too (`hooked`)."""
    stack = decoder(model)
    out = []
    for seq in sequences:
        sink: States = {}
        with hooked(stack, engine=False, sink=sink, gates=gates):
            model(input_ids=torch.tensor([list(seq)], device=device))
        out.append(joined(sink, len(seq), "trainer"))
    return out


def relative_l2(states: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per token, ‖states − reference‖ / ‖reference‖ in fp64 (a zero reference row: the absolute distance)."""
    a, b = states.to(torch.float64), reference.to(torch.float64)
    norm = b.norm(dim=-1)
    diff = (a - b).norm(dim=-1)
    return torch.where(norm > 0, diff / torch.where(norm > 0, norm, torch.ones_like(norm)), diff).tolist()


def distances(states: Sequence[dict[str, torch.Tensor]], reference: Sequence[dict[str, torch.Tensor]],
              names: Sequence[str]) -> dict[str, list[list[float]]]:
    """Point name -> per sequence, per token `relative_l2` of `states` from `reference`."""
    return {name: [relative_l2(s[name], r[name]) for s, r in zip(states, reference, strict=True)] for name in names}


def engine_stack(llm: Any) -> Any:
    """The decoder stack of an in-process vLLM engine's model (`LLM.apply_model` returns the object itself when the
    engine runs in this process); `ValueError` for an engine in other processes (its model cannot be hooked here)."""
    import os

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise ValueError("the engine runs in other processes (VLLM_ENABLE_V1_MULTIPROCESSING is not 0): its model "
                         "cannot be hooked here")
    stacks = llm.apply_model(decoder)
    if len(stacks) != 1 or not isinstance(stacks[0], torch.nn.Module):
        raise ValueError(f"the engine has {len(stacks)} workers; locate hooks one in-process model")
    return stacks[0]


def engine_states(stack: Any, score_one: Callable[[list[int]], object], sequences: Sequence[Sequence[int]],
                  gates: Sequence[Any] = ()) -> list[dict[str, torch.Tensor]]:
    """Every point's hidden state of each sequence on the engine: `score_one` makes it compute one sequence's
    prefill (its prompt logprobs), with hooks on `stack` (`engine_stack`) and on `gates`."""
    out = []
    for seq in sequences:
        sink: States = {}
        with hooked(stack, engine=True, sink=sink, gates=gates):
            score_one(list(seq))
        out.append(joined(sink, len(seq), "engine"))
    return out


@torch.no_grad()
def scale_norm(stack: Any, layer: int, factor: float) -> str:
    """Multiply decoder layer `layer`'s input_layernorm weight by `factor` in this model only (a planted fault);
    the module's name."""
    layers = stack.layers
    if not 0 <= layer < len(layers) or not hasattr(layers[layer], "input_layernorm"):
        raise ValueError(f"no input_layernorm in layer {layer} of {len(layers)}")
    layers[layer].input_layernorm.weight.mul_(factor)
    return f"layers.{layer}.input_layernorm"


def eager_experts(model: Any) -> None:
    """HF's MoE experts computed by plain matmuls (`experts_implementation="eager"`), on a model that has them:
    torch's grouped_mm, transformers 5's default on the CPU, takes no fp64 (the fp64 forward of an MoE model)."""
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if can_set is not None and can_set():
        model.set_experts_implementation("eager")


def machine_eps(dtype: str) -> float:
    """Machine epsilon of a dtype named as in configs (float32, bfloat16, float16)."""
    return float(torch.finfo(getattr(torch, dtype)).eps)
