"""The receipt's record of route replay on an MoE model (R3, docs/moe.md); re-exported by
`lora_parity.evidence.receipt`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lora_parity.evidence.receipt_models import Strict

ReplayMode = Literal["on", "off", "auto"]
ReplayStatus = Literal["replayed", "off", "not_available"]


class RouteReplay(Strict):
    """Whether the trainer replayed the engine's expert routes (route replay, R3: the routers take the experts the
    engine's pass of the same point chose, the routing weights stay the trainer's own), on an MoE model.

    The routes are raw data the run recorded (as the scores are); `lora-parity verify` checks their shape against
    the probes, that every source is a recorded pass, and re-derives `changes` from them."""

    mode: ReplayMode
    """`--route-replay` (or the config's `route_replay`) as asked: on, off, or auto (on where both sides can)."""
    status: ReplayStatus
    """replayed, off (asked), or not_available (a side cannot: `reason`)."""
    reason: str
    """Why it is off or not available, or what was replayed, in one line."""
    weights: str | None = None
    """How the trainer weighs the replayed experts (its own router's scores over them, renormalized or not)."""
    sources: dict[str, str] = Field(default_factory=dict)
    """Score key of a trainer-side pass (the trainer's, or the fp32 reference's, or `calibrate` / `perturb` for
    the forwards of the update's search and step) -> the engine pass whose routes it replayed."""
    routes: dict[str, list[list[list[list[int]]]]] = Field(default_factory=dict)
    """Engine pass (a score key: zero, stale, updated, target.K.sampler) -> the experts it routed each token to,
    [sequence][token][MoE layer] -> expert ids, ascending, for every token of the probes."""
    changes: dict[str, int] = Field(default_factory=dict)
    """Engine pass other than zero -> its (sequence, token, layer) triples routed to another expert set than the
    zero pass's (0: the same routes). Re-derived from `routes` by `verify`."""
