"""The result of `lora-parity locate` (docs/locate.md): where in the base forward trainer and engine part, as data.

Each point of the forward (the embedding, each decoder layer's modules, the final norm) carries each side's distance
from the fp32 reference over the picked sequences' tokens, the precision witness it is judged against, the
thresholds the rule derived from them and whether the side leaves there. Strict like the receipt (`Strict`): a
locate file is written once, never edited.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lora_parity.evidence.receipt_models import Strict

LOCATE_SCHEMA_VERSION = 1

Side = Literal["trainer", "engine"]


class LocateRule(Strict):
    """The rule's constants (verdict/locate_rule.py, docs/locate.md): a side leaves what its precision explains at a
    point where its distance from fp32, less `k` of its standard errors, exceeds `balance` × the precision witness's
    distance there plus `k` of the witness's standard errors (the median), or `balance` × the largest of its tokens'
    count the witness's tail predicts (the max)."""

    balance: float = Field(default=2.0, ge=1)
    """How many times the witness's distance from fp32 a side of the same precision may be (A.fp32.balance's 2:
    two computations of one precision are about equally far from fp32; their kernels' accuracy may differ)."""
    k: float = Field(default=3.0, ge=0)
    """Standard errors (jackknife over the sequences) on each side of the comparison."""
    tail_alpha: float = Field(default=1e-3, gt=0, lt=1)
    """The max's threshold: the largest of n tokens the witness's tail predicts with this chance of being passed
    by noise alone (the config's `budgets.noise.tail_alpha`, the noise model's, where it sets one)."""


class Spread(Strict):
    """One statistic of per-token distances, with its uncertainty."""

    value: float = Field(ge=0)
    """The statistic over every token of the picked sequences."""
    se: float = Field(ge=0)
    """Its jackknife standard error: over sequences (delete one), or over blocks of one sequence's tokens."""


class Distance(Strict):
    """Relative L2 distance from the fp32 reference, per token (‖h − h_fp32‖ / ‖h_fp32‖), summarized."""

    median: Spread
    """The median over tokens."""
    max: Spread
    """The largest over tokens."""


class SideAtPoint(Strict):
    """One side at one point of the forward."""

    distance: Distance
    """Its distance from the fp32 reference."""
    witness: Literal["other side", "fp32 vs fp64", "dtype rounding", "none"]
    """What measured the precision it is judged against: the other side's distance from fp32 (a computation of the
    same precision), the fp32 reference's own distance from an fp64 forward (what fp32 rounding explains there),
    whichever is larger; where both are zero (nothing computed differently there), the dtype's rounding of one
    reduction over the hidden dimension (`LocateResult.rounding_floor`)."""
    median_threshold: float = Field(ge=0)
    """balance × (witness median + k se) + k × this side's median se: the median beyond it leaves."""
    max_threshold: float = Field(ge=0)
    """balance × the largest of as many tokens as the witness's tail predicts (p90 + β ln(0.1 n / α), β from its
    p90 and p99): the max over tokens beyond it leaves."""
    leaves: bool
    """Whether the side leaves what its precision explains here (the median or the max beyond its threshold)."""


class Point(Strict):
    """One point of the forward where hidden states are compared, in forward order."""

    name: str
    """`embed`, `layers.I.input_layernorm` (that norm's output), `layers.I.self_attn` (the residual stream after
    attention), `layers.I.post_attention_layernorm`, `layers.I` (the stream after the MLP), `norm` (final norm)."""
    layer: int | None
    """The decoder layer (0-based), None for the embedding and the final norm."""
    module: str
    """What computes between the previous point and this one: where a side that first leaves here parts."""
    trainer: SideAtPoint
    """The trainer (HF + PEFT at zero-init, the checkpoint's dtype)."""
    engine: SideAtPoint
    """The engine (the in-process vLLM model, base weights)."""
    fp32_vs_fp64: Distance | None = None
    """The fp32 reference's own distance from an fp64 forward (fp32 checkpoints only): what fp32 explains here."""
    left_out: int = Field(default=0, ge=0)
    """MoE: tokens left out here on both sides, routed apart from fp32 at a near tie by a side at this point's
    layer or before (`locate_routes.near_ties`): precision's, whatever their distance."""


class Divergence(Strict):
    """The first point where one side leaves what its precision explains."""

    side: Side
    point: str
    """`Point.name`."""
    layer: int | None
    """The decoder layer, None for the embedding or the final norm."""
    module: str
    """`Point.module`: where the side parts."""
    statistic: Literal["median", "max"]
    """Which statistic left (median first where both did)."""
    observed: float
    """That statistic of the side's distance from fp32."""
    threshold: float
    """Its threshold at the point."""


class PickedSequence(Strict):
    """A sequence picked by A's per-token differences (|zero − trainer_zero| in the receipt's raw scores)."""

    index: int = Field(ge=0)
    """Its index among the receipt's probe sequences."""
    num_tokens: int = Field(ge=1)
    """Tokens in it (every one's hidden state is compared)."""
    max_abs: float = Field(ge=0)
    """Largest |Δlogprob| of A on it."""
    mean_abs: float = Field(ge=0)
    """Mean |Δlogprob| of A on it."""


class RouterFlip(Strict):
    """One token whose top-k expert set differs somewhere among the fp32 reference, the trainer and the engine, at
    one MoE layer (each set ranked as the family's router ranks: `MoeRouting.ranking`)."""

    sequence: int = Field(ge=0)
    """The probe sequence (`PickedSequence.index`)."""
    position: int = Field(ge=0)
    """The token's position in it (0-based): its routing; the score entry of the same index (log p of the next
    token) is the first the flip reaches."""
    reference: list[int]
    """The fp32 reference's top-k experts, ascending."""
    trainer: list[int]
    """The trainer's."""
    engine: list[int]
    """The engine's."""
    margin: float
    """The reference's k-th ranked score minus its (k+1)-th: how far the token's routing is from a tie."""
    trainer_deviation: float = Field(ge=0)
    """The largest |trainer score − reference score| over the experts at this token."""
    engine_deviation: float = Field(ge=0)
    """The same for the engine."""
    near_tie: bool
    """margin ≤ `MoeLayer.tie_band`: a flip precision explains; else the gap is wide and a side's scores moved
    further than precision does (a divergence before the router)."""
    a_diff: float | None = None
    """A's |Δlogprob| at score entry `position` (the receipt's zero vs trainer_zero); None for a sequence's last
    token (it scores nothing)."""


class MoeLayer(Strict):
    """One MoE layer's routing on the picked sequences, the sides' against the fp32 reference's."""

    layer: int = Field(ge=0)
    """The decoder layer."""
    top_k: int = Field(ge=1)
    num_tokens: int = Field(ge=0)
    apart: int = Field(ge=0)
    """Tokens the trainer and the engine route to different expert sets."""
    trainer_flips: int = Field(ge=0)
    """Tokens the trainer routes otherwise than the fp32 reference."""
    engine_flips: int = Field(ge=0)
    """Tokens the engine routes otherwise than the fp32 reference."""
    margin_min: float
    """The smallest reference margin (k-th minus (k+1)-th score) over the tokens."""
    margin_median: float
    """The median reference margin."""
    trainer_deviation: float = Field(ge=0)
    """p99 over tokens of the trainer's largest |score − reference score|."""
    engine_deviation: float = Field(ge=0)
    """The same for the engine."""
    fp64_deviation: float | None = None
    """The same for an fp64 forward (fp32 checkpoints): what fp32 rounding moves the scores by."""
    tie_band: float = Field(ge=0)
    """balance × the witness's p99 deviation (the nearer side's, or fp64's where larger): a flip whose reference
    margin is within it is a near tie."""
    witness: Literal["trainer", "engine", "fp32 vs fp64"]
    """Whose deviation set `tie_band`."""


class MoeRouting(Strict):
    """Router scores on the three forwards, per MoE layer, and the flips behind A's worst tokens."""

    ranking: str
    """What the routers rank (softmax of the logits; sigmoid plus the correction bias)."""
    layers: list[MoeLayer]
    """Every MoE layer, in forward order."""
    listed_layer: int | None
    """The layer whose flips are listed: the first MoE layer at or after the layer locate names, else the first
    with a flip; None where no layer has one."""
    listed_because: str
    """Why that layer (or that none is)."""
    flips: list[RouterFlip]
    """That layer's flips, the tokens with the largest A difference first (at most `MAX_FLIPS`)."""
    num_flips: int = Field(ge=0)
    """All of that layer's flipped tokens (`flips` may list fewer)."""


class LocateResult(Strict):
    """`lora-parity locate`: the first divergence of the base forward, per side."""

    schema_version: Literal[1] = 1
    """Version of this format."""
    kind: Literal["locate"] = "locate"
    """What this file is (a locate result, not a receipt)."""
    tool_version: str
    created_at: str
    """UTC, ISO 8601."""
    receipt_digest: str
    """The sha256 digest of the receipt located."""
    model: str
    """The config name."""
    dtype: str
    """The checkpoint's dtype: each side's precision."""
    trainer: str
    sampler: str
    a_failed: list[str]
    """The receipt's failing A checks (empty: A passed; locate still measures)."""
    sequences: list[PickedSequence]
    """The sequences compared, worst first."""
    rule: LocateRule
    rounding_floor: float = Field(ge=0)
    """√H × u of the checkpoint's dtype (H the hidden size, u its unit roundoff): the witness where nothing else
    measured the precision (`SideAtPoint.witness`)."""
    points: list[Point]
    """Every point, in forward order."""
    divergences: list[Divergence]
    """The first point each side leaves at (none: both sides stay within their precision everywhere)."""
    injected: str | None = None
    """A fault planted for the demonstration (`--inject engine-norm@K`): this result is not the receipt's run."""
    timings: dict[str, float]
    """Seconds per step."""
    moe: MoeRouting | None = None
    """MoE models: the router scores of every MoE layer on each side and their flips (absent: a dense model, or a
    result written before this field)."""
    moe_unavailable: str | None = None
    """An MoE model whose routers could not be compared, and why."""
