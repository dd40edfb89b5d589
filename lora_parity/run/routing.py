"""Router top-k agreement at zero-init, for MoE models: how often trainer and sampler route a
token to the same expert set. A diagnostic: recorded in the receipt, never a check. And router
top-k margins (how close a token's routing is to a flip), pure, for scripts/router-margins.py."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lora_parity.backends.base import Routes, RoutingIntrospection, Sampler, Trainer
from lora_parity.evidence.receipt import RouterAgreement
from lora_parity.verdict import stats
from lora_parity.verdict.routes import flipped_tokens

ROUTER_STATE = "zero-init trainer (B = 0) vs the sampler's base model"


def _not_available(reason: str) -> RouterAgreement:
    return RouterAgreement(status="not_available", reason=reason, state=ROUTER_STATE)


def _measured(trainer_routes: Routes, sampler_routes: Routes, sequences: list[list[int]]) -> RouterAgreement:
    per_layer = stats.topk_agreement(trainer_routes, sampler_routes)
    first = trainer_routes[0][0] if trainer_routes and trainer_routes[0] else []
    return RouterAgreement(status="measured", state=ROUTER_STATE, num_layers=len(per_layer),
                           top_k=len(first[0]) if first else 0, num_tokens=sum(len(s) for s in sequences),
                           agreement=math.fsum(per_layer) / len(per_layer) if per_layer else 0.0,
                           per_layer=per_layer, flipped_tokens=flipped_tokens(trainer_routes, sampler_routes))


def router_agreement(trainer: Trainer, sampler: Sampler, sampler_name: str,
                     sequences: list[list[int]]) -> RouterAgreement | None:
    """None for a dense model or a trainer without `RoutingIntrospection`; `not_available` with the
    reason when the sampler does not report its routing or a capture fails (never a guess)."""
    if not isinstance(trainer, RoutingIntrospection):
        return None
    try:
        trainer_routes = trainer.router_topk(sequences)
        if trainer_routes is None:
            return None
        if not isinstance(sampler, RoutingIntrospection) or sampler.traits.routing_unavailable:
            reason = sampler.traits.routing_unavailable or "the sampler does not expose its routing"
            return _not_available(f"{sampler_name}: {reason}")
        sampler_routes = sampler.router_topk(sequences)
        assert sampler_routes is not None, "the sampler found no routers where the trainer did"
        return _measured(trainer_routes, sampler_routes, sequences)
    except Exception as e:  # routing is a diagnostic: a capture that fails is recorded, the run goes on
        return _not_available(f"routing capture failed: {type(e).__name__}: {e}"[:300])


def topk_margin(scores: Sequence[float], top_k: int) -> float:
    """How far one token's routing is from a flip: the k-th highest expert score minus the highest
    score left out (the `top_k + 1`-th), on the scores the router ranks (after its scoring function
    and correction bias). 0 is a tie; a margin below the arithmetic's noise can pick another expert
    set on another kernel. Raises ValueError unless 0 < top_k < len(scores)."""
    if not 0 < top_k < len(scores):
        raise ValueError(f"top_k must be in 1..{len(scores) - 1}, got {top_k}")
    ranked = sorted((float(s) for s in scores), reverse=True)
    return ranked[top_k - 1] - ranked[top_k]


def margin_ranks(margins: Sequence[float], positions: Sequence[int]) -> list[int]:
    """Rank of each of `positions` (indices into `margins`) among all margins, 1 = the smallest;
    ties take the best rank they share, so a position ranks k when exactly k - 1 margins are smaller."""
    return [1 + sum(1 for m in margins if m < margins[p]) for p in positions]
