"""The receipt's statistics records: one comparison's, one change's (delta), one check's and a worst position
(`lora_parity.evidence.receipt` re-exports every name)."""

from __future__ import annotations

from typing import Literal

from lora_parity.evidence.receipt_models import CheckStatus, Strict


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
    equal: float | None = None
    """Fraction of positions where the two scores are bitwise equal (diff exactly 0); None: a receipt made
    before it was recorded."""


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
    reference_to: str | None = None
    """The fp32 reference phase at the change's end point, where C and T are triangulated
    (`NoiseRule.delta_reference`): then cosine, scale and rel_l2 compare Δsampler with Δfp32 (`reference_fp32` to
    it: what both sides approximate). None: they compare Δsampler with Δtrainer (and in receipts made before it)."""
    reference_norm: float | None = None
    """‖Δfp32‖, where triangulated."""
    trainer_cosine: float | None = None
    """cosine(Δtrainer, Δfp32), where triangulated: the trainer's own precision at this point."""
    trainer_scale: float | None = None
    """‖Δtrainer‖ / ‖Δfp32‖, where triangulated."""
    trainer_rel_l2: float | None = None
    """‖Δtrainer - Δfp32‖ / ‖Δfp32‖, where triangulated: what one bf16 side's change is off the true one here."""
    direct_cosine: float | None = None
    """cosine(Δsampler, Δtrainer), where triangulated and the rule compares the two directly too
    (`NoiseRule.delta_direct`); None otherwise."""
    direct_scale: float | None = None
    """‖Δsampler‖ / ‖Δtrainer‖, there."""
    direct_rel_l2: float | None = None
    """‖Δsampler - Δtrainer‖ / ‖Δtrainer‖, there."""


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
    elements: int | None = None
    """How many elements it compared: scored positions (a pooled slope: positions x the runs it pools). A check
    over none is not run, never passed. None in receipts made before it was recorded."""


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
