"""The receipt's building blocks: the strict base model, status enums, and the statistics, checks and
diagnostics records a receipt holds (`lora_parity.receipt` re-exports every name)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

JsonScalar = str | int | float | bool | None


class Strict(BaseModel):
    """Base of every receipt model: frozen, no extra fields, documented fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class Verdict(StrEnum):
    """Outcome of a run."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"


class CheckStatus(StrEnum):
    """Outcome of one check."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    NOT_REACHED = "not_reached"


class PhaseStatus(StrEnum):
    """Outcome of one phase of the sequence."""

    OK = "ok"
    ERROR = "error"


class ComparisonStats(Strict):
    """Statistics of diff = b - a for one comparison."""

    a: str
    """Score phase subtracted (reference)."""
    b: str
    """Score phase compared."""
    n: int
    """Number of positions."""
    mean_abs: float
    """Mean |diff|."""
    p50: float
    """Median |diff|."""
    p99: float
    """99th percentile of |diff| (linear interpolation)."""
    max_abs: float
    """Largest |diff|."""
    argmax: list[int]
    """[sequence, position] of the largest |diff|."""
    frac_over: float
    """Fraction of positions with |diff| above the mean budget."""
    k3_kl: float
    """k3 estimate of KL(a || b): mean of exp(d) - 1 - d."""
    mult_prob_error: float
    """Mean of exp(|diff|) (NeMo-RL's token_mult_prob_error)."""


class DeltaStats(Strict):
    """Agreement of the sampler's change with the trainer's change."""

    sampler_from: str
    """Sampler phase before the change."""
    sampler_to: str
    """Sampler phase after the change."""
    trainer_from: str
    """Trainer phase before the change."""
    trainer_to: str
    """Trainer phase after the change."""
    cosine: float | None
    """cosine(Δsampler, Δtrainer); None if either change is exactly zero."""
    scale: float | None
    """‖Δsampler‖ / ‖Δtrainer‖; None if the trainer did not change."""
    rel_l2: float | None
    """‖Δsampler - Δtrainer‖ / ‖Δtrainer‖; None if the trainer did not change."""
    sampler_norm: float
    """‖Δsampler‖."""
    trainer_norm: float
    """‖Δtrainer‖."""


class Check(Strict):
    """One check and its outcome."""

    id: str
    """Stable id, e.g. 'A.parity.max'."""
    name: str
    """What is checked, in words."""
    status: CheckStatus
    """Outcome."""
    observed: float | None
    """Observed value, when reached."""
    budget: float | None
    """Threshold it was compared with."""
    op: Literal["<=", ">=", ">"]
    """How observed is compared with budget."""
    reason: str
    """Why it has its status, in one line."""


class WorstPosition(Strict):
    """One of the positions where a comparison's two phases differ most."""

    sequence: int
    """Probe sequence index."""
    position: int
    """Scored position t in that sequence: the logprob of tokens[t+1] given tokens[:t+1]."""
    token: int
    """The token id scored there, tokens[t+1]."""
    abs_diff: float
    """|b - a| at that position."""


class RouterAgreement(Strict):
    """Whether trainer and sampler route each probe token to the same experts (MoE models only).

    Raw data the run recorded, not recomputable from the scores: `lora-parity verify` checks only
    that it is well formed.
    """

    status: Literal["measured", "not_available"]
    """measured, or not_available when a side does not expose its routing."""
    reason: str | None = None
    """Why it is not available (which side, and why), when it is not."""
    state: str
    """The model state compared, e.g. the zero-init trainer vs the sampler's base model."""
    num_layers: int | None = None
    """MoE layers compared."""
    top_k: int | None = None
    """Experts per token."""
    num_tokens: int | None = None
    """Probe tokens compared per layer (every token of every sequence)."""
    agreement: float | None = None
    """Fraction of (token, layer) pairs whose top-k expert sets are equal on both sides."""
    per_layer: list[float] | None = None
    """That fraction per MoE layer, in layer order."""


class BucketStats(Strict):
    """|Δlogprob| over the scored positions of one bucket."""

    bucket: str
    """The bucket: a trainer-logprob range ('lp > -1', '-5 < lp <= -1', '-10 < lp <= -5',
    'lp <= -10') or a position quartile ('q1' first quarter of each sequence's positions ... 'q4')."""
    n: int
    """Scored positions in the bucket."""
    mean_abs: float | None
    """Mean |diff| over them; None for an empty bucket."""
    max_abs: float | None
    """Largest |diff|; None for an empty bucket."""


class ErrorBreakdown(Strict):
    """Where the trainer-sampler disagreement of one comparison sits, recomputable from `scores`."""

    by_logprob: list[BucketStats]
    """By the trainer's logprob of the scored token, most likely first."""
    by_position: list[BucketStats]
    """By position quartile within each sequence (position t of T scored: quartile floor(4t/T) + 1)."""


class CRelative(Strict):
    """Check C judged against check A: after sync the disagreement must return to the zero-init level."""

    factor: float = Field(gt=0)
    """C's mean, p99 and max |diff| may each be at most factor × A's same statistic + floor."""
    floor: float = Field(ge=0)
    """Added to every relative budget, so that a near-zero A does not make C fail on rounding."""


class ATriangulation(Strict):
    """Check A judged on precision, where the fp32 reference was scored (R.trainer_vs_fp32, R.sampler_vs_fp32)."""

    factor: float = Field(gt=0)
    """A's mean and p99 |diff| may be at most factor × the larger side's distance from fp32 (same statistic)."""
    mean: float = Field(gt=0)
    """Ceiling on each side's mean |diff| from fp32."""
    p99: float = Field(gt=0)
    """Ceiling on each side's p99 |diff| from fp32."""
    max: float = Field(gt=0)
    """Ceiling on each side's max |diff| from fp32, and on A's own max |diff| (one bad token fails)."""


class GroupVerdict(Strict):
    """The verdict of one group of checks."""

    verdict: Verdict
    """error (the run errored), fail, inconclusive (or a check not reached, or no check) or pass."""
    decided_by: list[str]
    """Ids of the checks that decided it: the failing ones for fail, the inconclusive and unreached
    ones for inconclusive, every check of the group for pass; empty for error."""


class Verdicts(Strict):
    """The run's verdict split in two (see docs/verdicts.md); the run's verdict is the worse of both.

    A check's group follows from its id: numerics = A.parity.*, A.fp32.*, A.noise.* (how far the two
    sides' arithmetic lets them agree); sync = every other check (is the LoRA path right)."""

    sync: GroupVerdict
    """Is the LoRA path right: B, C, the delta checks, per-target coverage, S.*, A.zero_adapter_noop."""
    numerics: GroupVerdict
    """Do the two sides agree at zero-init as closely as their precision allows: A's parity and noise."""
