"""The receipt's building blocks: the strict base model, status enums, and the statistics, budgets, checks
and diagnostics records a receipt holds (`lora_parity.evidence.receipt` re-exports every name)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
    flipped_tokens: int | None = None
    """Tokens the two sides route to another expert set in at least one MoE layer: without route replay their
    difference is in A. None where not measured (or a receipt made before it was recorded)."""


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


class NoiseRule(Strict):
    """The one rule that turns the noise measured at the start point into every threshold
    (`lora_parity.verdict.thresholds`, docs/verdicts.md). Absent from receipts made before it existed:
    their checks keep the rules they were made with."""

    stimulus_margin: float = Field(default=2.0, ge=1)
    """B.stimulus: the trainer's own change must be at least this many times C's mean threshold (and
    at least min_stimulus), so that a stale sampler, which shows C the whole change, fails C clearly."""
    calibration_ceiling: float = Field(default=1.5, gt=1)
    """std auto: the trainer's change must land in [lower, ceiling × lower] (lower: the stimulus the
    update needs); an update far above it only adds bf16 tails."""
    relative_k: float = Field(default=2.0, ge=0)
    """Tails and directions may differ by relative_k × ρ of the change itself, ρ the start point's
    relative disagreement (mean |trainer - sampler| / mean |logprob|): a token moved by Δ is computed
    with an error about ρ|Δ| on either side."""
    tail_alpha: float = Field(default=1e-3, gt=0, lt=1)
    """Chance that noise alone puts one of n tokens above the predicted max (exponential tail of the
    start point's |diff| above its 90th percentile)."""
    own_tail: bool = False
    """C's and G's max may also reach the tail their own bulk predicts (p90 and p99 of their |diff|: a
    change widens the whole error distribution; one or two tokens beyond it still fail). False in receipts
    made before it (the start point's tail alone): on the H200, Megatron's C max at one position-1 token
    was 0.81 against 0.73 on a correct sync."""
    max_as_at_start: bool = False
    """C's, P's and G's max are at least A's max threshold where that is the fp32-triangulated ceiling
    (`budgets.a_triangulation.max`): one token the start point's precision is allowed is allowed after the
    change too. False in receipts made before it: on the H200 (SmolLM2-135M bf16, hf, seed 3) one token after
    BOS was 1.75 nats apart after a sync the exact check proved, against C's 0.91 and A's ceiling 2.0."""
    max_at_start_factor: float = Field(default=1.0, ge=1)
    """With `max_as_at_start`: C's, P's and G's max are at least this many times A's one-token ceiling. Each
    side may be the ceiling away from fp32 at one token (A.fp32.*.max), so after a change the two may be
    up to twice it apart (triangle inequality). 1 in receipts made before it: on the H200 (SmolLM2-135M
    bf16, hf, 20 sequences) one token right after BOS was 3.17 nats apart after a sync the exact check
    proved, each side at most 1.45 from fp32 there at the start point."""
    max_growth_from: int | None = Field(default=None, ge=1)
    """The one-token ceiling (`a_triangulation.max`: A.parity.max where triangulated, A.fp32.*.max, and what
    `max_as_at_start` carries) was set on runs of this many sequences; with N > it, the ceiling grows by
    β ln(N / max_growth_from), β the Gumbel scale of the per-sequence maxima of both sides' distance from
    fp32 (interquartile range / 1.5725), as the largest of N such maxima grows (`thresholds.sequence_growth`).
    None in receipts made before it (the fixed ceiling): on the CPU (SmolLM2-135M bf16, 20 sequences)
    the sampler was 2.05 nats from fp32 at one token right after BOS, against 2.0."""
    fp32_balance: float | None = Field(default=None, ge=1)
    """A.fp32.balance: the side farther from the fp32 reference (mean |diff|) is at most this many times the
    nearer side's distance plus the mean budget. Two sides of one precision are about equally far from fp32;
    a side that is not (a published start adapter other than the trainer's) also widens A's triangulated
    threshold, which then cannot see it. None by default (an fp32-exact side would trip it on precision
    alone) and in receipts made before it: on the H200 (SmolLM2-135M bf16,
    Megatron, --update step, seed 2) a start adapter published with other B put the sampler 0.225 from fp32
    against the trainer's 0.057, while every A check passed."""
    slope_k: float | None = Field(default=None, gt=0)
    """C.slope: the sampler's share of the trainer's change pooled over C and every per-target run (against the
    fp32 reference's change where scored) is 1 within this many jackknife standard errors + `slope_floor`
    (`deltas.update_slopes`). None in receipts made before it: no C.slope check."""
    target_slope_k: float | None = Field(default=None, gt=0)
    """T.K.slope: each per-target and per-layer run's own slope, 1 within this many standard errors +
    `slope_floor` (more runs than C.slope's one, so a larger k). None in receipts made before it."""
    slope_floor: float = Field(default=0.0, ge=0)
    """What C.slope allows beyond k standard errors: the smallest scale error the run claims to resolve."""
    x_proves_delivery: bool = False
    """Where the exact check passed (X.sync.identical: the engine served the trainer's tensors bit for bit)
    and the sampler moved only after the sync, the checks that compare what the two sides compute with those
    tensors (C.parity, C.delta, C.slope, T.* direction and scale, G.trainer) judge the computation (the
    numerics verdict), never the delivery (the sync verdict). False in receipts made before it."""
    updated_reference: bool = False
    """C's mean and p99 also allow the trainer's distance from the fp32 reference at the updated point
    (`reference_fp32_updated`; `thresholds._updated_parity`). False in receipts made before it."""
    delta_reference: bool = False
    """C.delta's and each target's direction, scale and rel_l2 compare Δsampler with the fp32 reference's change
    where it was scored at the end point (`DeltaStats.reference_to`), within the start point's noise or the factor
    (`a_triangulation.factor`) × the trainer's own distance from that change, whichever is larger: the trainer's
    precision no longer counts against the engine, and a deviation names the side that is off. False in receipts
    made before it: on the H200 (SmolLM2-135M bf16, a user's adapter, seed 6) T.o_proj.cosine failed 0.910
    against 0.938 on a sync the exact check and the exact reference proved, the trainer 0.262 off fp32's change
    and the engine 0.306."""
    delta_direct: bool = False
    """Where triangulated (`delta_reference`), each direction, scale and rel_l2 check also compares Δsampler with
    Δtrainer (`DeltaStats.direct_cosine` ...) against the start point's noise, and passes where that comparison
    decides and passes: the engine computed the trainer's change, whatever both sides' distance from the true one.
    The fp32 comparison still fails a check where it decides and the direct one does not pass; where it cannot
    decide and the direct one fails, the check is inconclusive. False in receipts made before it: on the H200
    (SmolLM2-135M bf16, --sampler hf, random probes, seeds 0, 4, 8 at a3e0592) both sides' changes were equal bit
    for bit and 1.19 off the fp32 reference's (bf16 precision as large as the change), and every run was judged
    inconclusive."""
    mixed_fp32: bool = False
    """M.* may also reach twice the sampler's largest distance from the fp32 reference at the start point
    (`R.sampler_vs_fp32`, where scored): both computations of a request, alone and in the mixed batch, round the one
    fp32 value, so they are at most the sum of their distances from it apart (the triangle inequality), while a
    request served another route's adapter moves by the update's effect. False in receipts made before it (the
    control batch alone): on an H100 over HTTP (vLLM 0.26, SmolLM2-135M bf16, at 44419e5) the server scheduled one
    request of three clean runs' mixed batches otherwise than alone (124 of 127 tokens moved, max 0.30) while their
    control batch matched alone bit for bit, so M's budget was the floor 1e-4."""


class Budgets(Strict):
    """Thresholds the checks apply; copied from the model config into every receipt."""

    mean: float = Field(gt=0)
    """Largest allowed mean |logprob diff| between trainer and sampler (checks A and C)."""
    p99: float = Field(gt=0)
    """Largest allowed 99th percentile of |diff| (checks A and C)."""
    max: float = Field(gt=0)
    """Largest allowed single-position |diff|, so one bad token cannot hide in the mean."""
    min_stimulus: float = Field(gt=0)
    """Smallest mean |diff| the update must cause between the updated trainer and the stale
    sampler (check B); below it the run is inconclusive, never a pass."""
    repeat_max: float = Field(ge=0)
    """Largest allowed |diff| between two scorings of the same state by the same side."""
    noise_floor: float = Field(ge=0)
    """Smallest noise tolerance, used when a side's repeat noise is exactly zero."""
    noise_factor: float = Field(ge=1)
    """Noise tolerance = max(noise_factor × observed sampler repeat max, noise_floor)."""
    min_delta_cosine: float = Field(ge=-1, le=1)
    """Smallest cosine between the sampler's and the trainer's change from zero-init to updated."""
    max_delta_scale_error: float = Field(ge=0)
    """Largest allowed |‖Δsampler‖/‖Δtrainer‖ - 1|."""
    max_delta_rel_l2: float = Field(ge=0)
    """Largest allowed ‖Δsampler - Δtrainer‖/‖Δtrainer‖."""
    min_target_snr: float | None = Field(default=None, gt=0)
    """Per-target direction and scale (T.*.cosine, T.*.scale) are decided only where the trainer's
    change under that target alone is at least this many times ‖trainer - sampler‖ at zero-init (the
    two sides' own disagreement, L2 over all positions); below it they are inconclusive: the change
    is lost in the noise. Absent (receipts made before this budget existed): always decided."""
    profile: str | None = None
    """Which budget profile these are ('seed', 'fp32', 'bf16': configs/budgets/; older receipts:
    'tiny-qwen3 (float32)', 'qwen3-0.6b-synth (bfloat16)'), set for a checkpoint passed by path (its
    dtype picks one) and by `run --budgets`; None: the config's own."""
    c_relative: CRelative | None = None
    """C's parity budgets relative to A's observed disagreement; None: C uses mean, p99, max (absolute)."""
    a_triangulation: ATriangulation | None = None
    """A judged against the fp32 reference where it was scored; None, or no reference scored: A uses
    mean, p99, max (absolute)."""
    target_noise_k: float | None = Field(default=None, gt=0)
    """Safety factor k of the noise-derived delta thresholds: with ε = ‖trainer_zero - zero‖ and |t| =
    ‖Δtrainer‖, cosine >= min(min_delta_cosine, cos(asin(min(1, kε/|t|)))), scale and rel_l2 errors <=
    max(their budget, kε/|t|) (C.delta and T.*); where kε/|t| >= 1 they are inconclusive (noise explains
    any change). None: the fixed budgets alone."""
    exact: bool = False
    """A, C and P parity judged bitwise (`--budgets exact`): any non-zero difference fails, as it must where
    the trainer computes what the sampler computes (the `exact` trainer, docs/verdicts.md)."""
    noise: NoiseRule | None = None
    """The noise model's rule (`lora_parity.verdict.thresholds`): B's stimulus, C's tail, the generation checks and
    the calibration window derive from the noise measured at the start point. None: receipts made before
    it, judged by the rules they were made with."""

    @model_validator(mode="after")
    def _ordered(self) -> Budgets:
        if not self.mean <= self.p99 <= self.max:
            raise ValueError("budgets must satisfy mean <= p99 <= max")
        if self.min_stimulus < self.mean:
            raise ValueError("min_stimulus must be at least the mean budget, or a stale sampler could pass")
        return self


class NoiseModel(Strict):
    """The noise measured once at the start point (the user's adapter, or zero-init), from which
    every threshold is derived (`lora_parity.verdict.thresholds`); `verify` recomputes it from the scores."""

    start: Literal["zero-init", "start adapter"]
    """Where the sides start: B = 0, or the user's adapter (`--adapter`)."""
    n: int
    """Scored positions."""
    mean: float
    """Mean |trainer - sampler| at the start point (A)."""
    p99: float
    """Its 99th percentile."""
    max: float
    """Its largest value."""
    l2: float
    """‖trainer - sampler‖ over all positions: the noise a change's direction is judged against."""
    tail_p90: float
    """90th percentile of |trainer - sampler|: where the fitted tail starts."""
    tail_scale: float
    """The exponential tail's scale: (p99 - p90) / ln 10 of |trainer - sampler| (robust to a few bad tokens)."""
    relative: float
    """ρ: mean |trainer - sampler| / mean |sampler logprob|, the relative precision of the two sides."""
    repeat: float
    """The larger of the two sides' repeat max |diff| (0 for deterministic engines)."""


class ThresholdRecord(Strict):
    """One check's threshold, derived before the checks ran (`lora_parity.verdict.thresholds`)."""

    budget: float
    """The number the check's observed value is compared with."""
    rule: str
    """How it was derived, in words (the inputs included)."""
    undecidable: bool = False
    """Noise as large as the change: the check can be neither passed nor failed (inconclusive)."""


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
class CalibrationStep(Strict):
    """One std the calibration tried, and the trainer's change at it."""

    std: float
    """Std of the B noise."""
    trainer_change: float
    """Mean |trainer after − trainer_zero| over the scored positions, the trainer alone."""


class Calibration(Strict):
    """The search for the B-noise std (`perturbation.std: auto`, see `lora_parity.verdict.calibrate`):
    `lora-parity verify` rechecks the rule from these numbers and the scores."""

    a_mean: float
    """A's mean disagreement, mean |zero − trainer_zero|: the noise the update must stand out of."""
    factor: float
    """k: the trainer change must be at least k · a_mean (`perturbation.stimulus_factor`)."""
    min_stimulus: float
    """And at least this (the budgets' min_stimulus)."""
    target: float
    """max(factor · a_mean, min_stimulus)."""
    start_std: float
    """First std of the ladder."""
    growth: float
    """Each step's std is the previous one's times this."""
    max_steps: int
    """Most steps (trainer forwards) the search may take."""
    steps: list[CalibrationStep]
    """Each std tried, in order; the last one is the chosen one."""
    std: float
    """The chosen std: the first that meets the target, else the last of the ladder."""
    met: bool
    """Whether the chosen std meets the target (if not, B's stimulus check decides)."""
    upper: float | None = None
    """The window's top (`NoiseRule.calibration_ceiling` × target): the search bisects until the change
    lands in [target, upper]. None: receipts made with the older ladder (the first std over target)."""
    searched: Literal["std", "learning_rate"] = "std"
    """What the search varies: the B noise's std, or the optimizer step's learning rate (`--update
    step`; each step's `std`, `start_std` and the chosen `std` then hold learning rates)."""


class ErrorDetail(Strict):
    """Where a run that errored failed: the exception and its innermost frames."""

    where: str
    """'setup' or the phase that raised."""
    type: str
    """The exception's type name."""
    message: str
    """The exception's message (may be empty, as vLLM's bare AssertionError is)."""
    frames: list[str]
    """Innermost frames last, 'path:line function', paths relative to the package's parent or to
    site-packages (never a machine path)."""


class Reference(Strict):
    """Whether a reference (the fp32 one: scores `reference_fp32`; the exact one: `exact.*`) was scored, and why."""

    status: Literal["scored", "skipped"]
    """scored, or skipped."""
    reason: str
    """Why: asked for, a half-precision model whose fp32 copy fits, or why it was skipped."""
    fp32_bytes: int | None = None
    """Bytes of the fp32 copy's parameters, where measured."""
    available_bytes: int | None = None
    """Memory available for it (free GPU memory, else available host RAM), where measured."""


SYNC_AT_ONCE = "at once"
"""The sampler's setting `sync_buckets` where the sync hands the weights over in one piece (`models.loop`)."""
GRAPHS_DECODE_ONLY = "on for decode batches only"
"""How a sampler whose CUDA graphs never run the scored prompts (prefill) starts its `cuda_graphs` setting (SGLang with
LoRA): the lifecycle row is covered only where the decode path was scored too (`--probes sampled`)."""


class LifecycleRow(Strict):
    """One condition of the engine as deployed, and whether this run exercised it (`verdict.lifecycle`).

    Derived from what the run recorded (its phases and the sampler's settings); `verify` recomputes it.
    """

    condition: str
    """The deployment condition: CUDA graphs, sleep and wake, a warm prefix cache, ..."""
    status: Literal["covered", "not covered"]
    """covered: a phase or setting of this run exercised it; not covered: nothing here tested it (never a pass)."""
    detail: str
    """What ran, or why it did not."""
