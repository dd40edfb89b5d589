"""`lora-parity locate` on an MoE model: the router scores of every MoE layer on each forward, judged by
`verdict.locate_routes` (docs/locate.md, "MoE").

The router logits are captured in the same forwards as the hidden states (`hidden_states.hooked`'s gates): on HF
models forward hooks on the routers (`moe.hf_gates`), on the in-process vLLM model on each MoE block's gate
(`moe.engine_gates`, `layers.I.mlp.gate`, a linear returning the logits). Each side's logits are turned into what
its router ranks (`moe.choice_scores`: softmax, or sigmoid plus the correction bias) in fp32, as the routers do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lora_parity.evidence.locate_models import Divergence, MoeRouting, PickedSequence
from lora_parity.verdict import locate_routes

PerSequence = Sequence[Mapping[str, Any]]
"""One sequence's captures (point or `router.I` -> tensor), per sequence."""


def hf_gates(model: Any) -> tuple[list[Any], str | None]:
    """The MoE gates of an HF model ([] for a dense one), or none and why they cannot be compared."""
    from lora_parity.backends import moe

    try:
        return moe.hf_gates(model), None
    except ValueError as e:
        return [], str(e)


def engine_gates(stack: Any, like: list[Any]) -> tuple[list[Any], str | None]:
    """The in-process engine's gates matching the trainer's `like`, or none and why."""
    from lora_parity.backends import moe

    if not like:
        return [], None
    try:
        return moe.engine_gates(stack, like), None
    except ValueError as e:
        return [], f"the engine's MoE gates: {e}"


def scores(states: PerSequence, gates: Sequence[Any]) -> dict[int, list[list[list[float]]]]:
    """Decoder layer -> [sequence][token][expert] the scores its router ranks (`moe.choice_scores`)."""
    from lora_parity.backends import moe
    from lora_parity.backends.hidden_states import ROUTER

    return {g.layer: [moe.choice_scores(g, s[f"{ROUTER}{g.layer}"]).tolist() for s in states] for g in gates}


def a_differences(receipt_scores: Mapping[str, Sequence[Sequence[float]]],
                  picked: Sequence[PickedSequence]) -> list[list[float]]:
    """A's |zero − trainer_zero| per score entry of each picked sequence."""
    return [[abs(a - b) for a, b in zip(receipt_scores["zero"][p.index], receipt_scores["trainer_zero"][p.index],
                                        strict=True)] for p in picked]


def named_layer(divergences: Sequence[Divergence]) -> int | None:
    """The earliest decoder layer locate names (a departure at the embedding: layer 0; at the final norm: none)."""
    layers = [d.layer if d.layer is not None else 0 for d in divergences if d.layer is not None or d.point == "embed"]
    return min(layers, default=None)


def routing(captures: Mapping[str, tuple[PerSequence, Sequence[Any]]], picked: Sequence[PickedSequence],
            receipt_scores: Mapping[str, Sequence[Sequence[float]]], divergences: Sequence[Divergence],
            balance: float, layers: Sequence[locate_routes.LayerScores]) -> MoeRouting:
    """The MoE record of a locate run: `captures` holds each forward's states and its own gates (the same layers on
    every side) under `reference`, `trainer`, `engine` and, for an fp32 checkpoint, `fp64`; `layers` is their
    `layer_scores`."""
    from lora_parity.backends.moe import RANKINGS

    gates = captures["reference"][1]
    ranking = "; ".join(sorted({RANKINGS[g.ranking] for g in gates}))
    return locate_routes.routing(layers, [p.index for p in picked],
                                 a_differences(receipt_scores, picked), named_layer(divergences), ranking, balance)


def layer_scores(captures: Mapping[str, tuple[PerSequence, Sequence[Any]]]) -> list[locate_routes.LayerScores]:
    """Each MoE layer's router scores on every forward of `captures` (see `routing`), the sequences in order."""
    per_side = {side: scores(states, gates) for side, (states, gates) in captures.items()}
    return [locate_routes.LayerScores(g.layer, g.top_k, per_side["reference"][g.layer], per_side["trainer"][g.layer],
                                      per_side["engine"][g.layer],
                                      per_side["fp64"][g.layer] if "fp64" in per_side else None)
            for g in captures["reference"][1]]
