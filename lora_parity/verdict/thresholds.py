"""Every check's threshold, derived once from the noise measured at the start point, before any check runs.

Pure: scores, comparisons and budgets in, a `NoiseModel` and a `Threshold` per check id out. The run
and `lora-parity verify` both call `derive`; the receipt records both (`noise`, `thresholds`).

The noise model (docs/verdicts.md, "One noise model") is measured at the start point (zero-init, or the
user's adapter): the trainer-vs-sampler disagreement (A: mean, p99, max, L2, and its tail above the
90th percentile), each side's repeat, and ρ, the two sides' relative precision. With `budgets.noise`
(a `NoiseRule`) one rule turns it into every threshold:

- A: against the fp32 reference (carrying the same start adapter) where it was scored, else absolute.
- C, P, G (after a change): factor × A's statistic + floor, the max at least the tail the noise model
  predicts for that many tokens, plus relative_k × ρ × the change's own statistic (a token moved by Δ
  is computed with an error of about ρ|Δ| on either side); with `max_as_at_start`, the max at least A's
  max threshold where that is the fp32-triangulated ceiling (what precision explains for one token).
- B.stimulus: the trainer's own change must be stimulus_margin × C's mean threshold (a stale sampler
  then fails C clearly) and at least min_stimulus; the calibration aims inside [that, ceiling × that].
- Directions (C.delta, T.*): noise of norm kε bends a change of norm |t| by at most asin(kε/|t| + relative_k ρ).
- withheld, moved, no-op: the sampler's repeat noise (noise_factor × repeat max, at least noise_floor).

Without `budgets.noise` (receipts made before it) each check keeps the rule it was made with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lora_parity.evidence.receipt import Budgets, ComparisonStats, DeltaStats, NoiseModel
from lora_parity.verdict import check_rules, engine_state, exact_reference, mixed_batch, sleep_wake, stats
from lora_parity.verdict.check_rules import STATS, Threshold

ScoreArray = Sequence[Sequence[float]]
TARGET_PREFIX = "target."
GENERATION_PREFIXES = ("G.sampled", "G.updated", "G.trainer")
EXACT_PREFIXES = ("A.parity", "C.parity", "P.parity")
"""The parity checks `budgets.exact` makes bitwise: trainer against sampler, prompt tokens scored whole (the
generation checks read decode steps, which no trainer forward computes)."""


def noise_model(scores: Mapping[str, ScoreArray], comparisons: Mapping[str, ComparisonStats]) -> NoiseModel | None:
    """The noise at the start point, or None where trainer and sampler were not both scored there."""
    a = comparisons.get("A.trainer_vs_sampler")
    if a is None or "zero" not in scores or "trainer_zero" not in scores:
        return None
    diffs = [abs(d) for d in stats.differences(scores["zero"], scores["trainer_zero"])]
    p90, scale = tail_of(diffs)
    logprobs = stats.flatten(scores["zero"])
    mean_logprob = math.fsum(abs(x) for x in logprobs) / len(logprobs)
    repeats = [c.max_abs for k in ("A.sampler_repeat", "A.trainer_repeat") if (c := comparisons.get(k)) is not None]
    return NoiseModel(
        start="start adapter" if "adapter_base" in scores else "zero-init",
        n=a.n, mean=a.mean_abs, p99=a.p99, max=a.max_abs, l2=stats.l2(diffs), tail_p90=p90, tail_scale=scale,
        relative=a.mean_abs / mean_logprob if mean_logprob > 0 else 0.0,
        repeat=max(repeats, default=0.0),
    )


Tail = tuple[float, float]
"""(p90, scale) of an exponential tail of |diff|: P(|d| > p90 + x) = 0.1 exp(-x / scale)."""


def tail_of(abs_diffs: Sequence[float]) -> Tail:
    """The exponential tail of |diff| above its 90th percentile, its scale from the 90th and 99th
    percentiles ((p99 - p90) / ln 10): one or two bad tokens among a few hundred do not widen it."""
    ordered = sorted(abs_diffs)
    p90 = stats.quantile(ordered, 0.90)
    return p90, (stats.quantile(ordered, 0.99) - p90) / math.log(10)


def own_tails(scores: Mapping[str, ScoreArray], pairs: Mapping[str, tuple[str, str]]) -> dict[str, Tail]:
    """The tail of each after-change comparison's own bulk (C, P, G), where both its phases were scored."""
    return {name: tail_of([abs(d) for d in stats.differences(scores[a], scores[b])])
            for name, (a, b) in pairs.items() if a in scores and b in scores}


Growth = tuple[int, float]
"""(N, β): the sequences scored at the start point, and the Gumbel scale of their per-sequence maxima."""
GUMBEL_IQR = math.log(math.log(4.0)) - math.log(math.log(4.0 / 3.0))
"""Interquartile range of a Gumbel distribution of scale 1 (1.5725)."""


def sequence_growth(scores: Mapping[str, ScoreArray]) -> Growth | None:
    """(N, β) at the start point: N sequences; β the Gumbel scale (interquartile range / GUMBEL_IQR) of the
    2N per-sequence maxima of |trainer − fp32| and |sampler − fp32|, how the largest one-token error of a
    sequence spreads between sequences (the largest of N such maxima grows by about β ln N). None without
    the fp32 reference."""
    ref = scores.get("reference_fp32")
    if ref is None or "zero" not in scores or "trainer_zero" not in scores:
        return None
    maxima = sorted(max((abs(a - b) for a, b in zip(row, ref_row, strict=True)), default=0.0)
                    for side in ("trainer_zero", "zero") for row, ref_row in zip(scores[side], ref, strict=True))
    if len(maxima) < 4:
        return len(ref), 0.0
    return len(ref), (stats.quantile(maxima, 0.75) - stats.quantile(maxima, 0.25)) / GUMBEL_IQR


def grown_ceiling(budgets: Budgets, growth: Growth | None) -> Threshold | None:
    """The one-token ceiling (`a_triangulation.max`) grown for N sequences where the rule says so
    (`NoiseRule.max_growth_from`): + β ln(N / max_growth_from); None where the fixed ceiling applies."""
    tri = budgets.a_triangulation
    start = budgets.noise.max_growth_from if budgets.noise is not None else None
    if tri is None or start is None or growth is None or growth[0] <= start:
        return None
    n, beta = growth
    return Threshold(tri.max + beta * math.log(n / start),
                     f"the fp32-triangulated max ceiling {tri.max:g} + β {beta:.4g} x ln({n} / {start}) for {n} "
                     f"sequences (β: the Gumbel scale of the per-sequence maxima of both sides' distance from fp32)")


def predicted_max(noise: NoiseModel | Tail, n: int, alpha: float) -> float:
    """The |diff| that noise alone exceeds at one of `n` tokens with chance `alpha`: an exponential tail
    (the start point's, or a comparison's own bulk) solved for n · P = alpha."""
    p90, scale = (noise.tail_p90, noise.tail_scale) if isinstance(noise, NoiseModel) else noise
    return p90 + scale * math.log(max(1.0, 0.1 * n / alpha))


def repeat_noise(budgets: Budgets, comparisons: Mapping[str, ComparisonStats], side: str) -> Threshold:
    """What one side's repeat noise allows a state's scores to move: noise_factor × its repeat max, at
    least noise_floor (withheld, moved, no-op: the sampler's; S.trainer_kept: the trainer's)."""
    repeat = comparisons.get(f"A.{side}_repeat")
    value = budgets.noise_floor if repeat is None else max(budgets.noise_factor * repeat.max_abs, budgets.noise_floor)
    if budgets.noise is None:  # receipts made before the noise rule recorded no derivation here
        return Threshold(value)
    if repeat is None:
        return Threshold(value, f"the noise floor (no {side} repeat measured)")
    return Threshold(value, f"max({budgets.noise_factor:g} x {side} repeat {repeat.max_abs:.3g}, "
                            f"floor {budgets.noise_floor:g})")


def after_change(budgets: Budgets, a: ComparisonStats | None, noise: NoiseModel | None,
                 change: ComparisonStats | None, n: int | None, own: Tail | None = None,
                 start_max: Threshold | None = None) -> dict[str, Threshold]:
    """Parity thresholds after a change (C, P, G): C relative to A where the budgets say so; with the
    noise rule, the max at least the tail predicted for `n` tokens from the start point's bulk or the
    comparison's own bulk (`own`: a change widens the whole error distribution; a token or two beyond its
    bulk still fail), and every statistic widened by relative_k × ρ × the change's own statistic
    (`change`: the trainer's change, where measured). `start_max`: A's max threshold where it is the
    fp32-triangulated ceiling; with `max_as_at_start` the max is at least it."""
    base = check_rules.c_parity_thresholds(budgets, a)
    rule = budgets.noise
    if rule is None or noise is None:
        return base
    out: dict[str, Threshold] = {}
    for short, field in STATS:
        value, note = base[short].budget, base[short].note or f"absolute {base[short].budget:g}"
        if short == "max" and n:
            tail = predicted_max(noise, n, rule.tail_alpha)
            # Its own bulk only where that bulk is itself within the p99 threshold: a change computed with
            # more error widens the whole distribution evenly; a broken sync's bulk is the change itself.
            calm = own is not None and rule.own_tail and own[0] + own[1] * math.log(10) <= out["p99"].budget
            bulk = predicted_max(own, n, rule.tail_alpha) if calm and own is not None else 0.0
            if max(tail, bulk) > value:
                value, note = max(tail, bulk), (f"the tail noise predicts for {n} tokens, {tail:.4g}" if tail >= bulk
                                                else f"the tail its own bulk predicts for {n} tokens, {bulk:.4g}")
        if change is not None and rule.relative_k > 0:
            extra = rule.relative_k * noise.relative * float(getattr(change, field))
            value, note = value + extra, f"{note} + {rule.relative_k:g} x ρ {noise.relative:.3g} x change {short} " \
                                         f"{float(getattr(change, field)):.4g}"
        out[short] = Threshold(value, note)
    carried = rule.max_at_start_factor * start_max.budget if start_max is not None else 0.0
    if rule.max_as_at_start and start_max is not None and carried > out["max"].budget:
        times = f"{rule.max_at_start_factor:g} x " if rule.max_at_start_factor != 1 else ""
        out["max"] = Threshold(carried, f"{times}A's max threshold, {carried:g} ({start_max.note}; "
                                        f"above the {out['max'].budget:.4g} the noise predicts)")
    return out


def stimulus(budgets: Budgets, a: ComparisonStats | None, noise: NoiseModel | None,
             change: ComparisonStats | None = None) -> Threshold:
    """B.stimulus: the smallest change the update must make. Noise rule: stimulus_margin × C's mean
    threshold, at least min_stimulus; before it, min_stimulus."""
    rule = budgets.noise
    if rule is None:
        return Threshold(budgets.min_stimulus)
    c_mean = after_change(budgets, a, noise, change, None)["mean"].budget
    value = max(budgets.min_stimulus, rule.stimulus_margin * c_mean)
    if value == budgets.min_stimulus:
        return Threshold(value, f"min_stimulus (above {rule.stimulus_margin:g} x C's mean threshold {c_mean:.4g})")
    return Threshold(value, f"{rule.stimulus_margin:g} x C's mean threshold {c_mean:.4g}")


def delta(budgets: Budgets, noise_l2: float | None, trainer_norm: float | None,
          noise: NoiseModel | None, precision: float | None = None,
          engine: float | None = None) -> check_rules.DeltaThresholds:
    """Direction, scale and rel_l2 thresholds of one delta (C.delta, T.*); `precision`, `engine`: where
    triangulated, the trainer's and the engine's rel_l2 from the fp32 change (`trainer_norm` is then ‖Δfp32‖)."""
    relative = 0.0
    if budgets.noise is not None and noise is not None:
        relative = budgets.noise.relative_k * noise.relative
    return check_rules.delta_thresholds(budgets, noise_l2, trainer_norm, relative, precision, engine)


def batching_l2(scores: Mapping[str, ScoreArray]) -> float | None:
    """‖trainer_updated_alt − trainer_updated‖: how far the updated trainer moves when only its batching
    changes (one sequence per call); None where it was not scored."""
    if "trainer_updated_alt" not in scores or "trainer_updated" not in scores:
        return None
    return stats.l2(stats.differences(scores["trainer_updated"], scores["trainer_updated_alt"]))


def slope(budgets: Budgets, measured: stats.Slope | None, against_reference: bool,
          per_target: bool = False) -> Threshold | None:
    """C.slope (`NoiseRule.slope_k`), or a target's T.K.slope (`per_target`, `target_slope_k`): |ratio − 1| at most
    k standard errors + the floor; None without the rule."""
    rule = budgets.noise
    k = None if rule is None else rule.target_slope_k if per_target else rule.slope_k
    if rule is None or k is None:
        return None
    if measured is None:
        return Threshold(rule.slope_floor, "no slope could be measured")
    _, se, blocks = measured
    regressor = "the fp32 reference's change" if against_reference else "the trainer's change"
    return Threshold(k * se + rule.slope_floor,
                     f"{k:g} x its standard error {se:.3g} (jackknife over {blocks} blocks of "
                     f"{stats.SLOPE_BLOCK} positions, against {regressor}) + floor {rule.slope_floor:g}")


def _slopes(budgets: Budgets, pooled: stats.Slope | None, against_reference: bool,
            each: Mapping[str, stats.Slope | None]) -> dict[str, Threshold]:
    """C.slope's threshold and every target's own (T.K.slope), where the rule has them."""
    out = {"C.slope": slope(budgets, pooled, against_reference)}
    out.update({f"T.{name[len(TARGET_PREFIX):]}.slope": slope(budgets, s, against_reference, per_target=True)
                for name, s in each.items() if name.startswith(TARGET_PREFIX)})
    return {k: t for k, t in out.items() if t is not None}


def _updated_parity(budgets: Budgets, comparisons: Mapping[str, ComparisonStats],
                    c: dict[str, Threshold]) -> dict[str, Threshold]:
    """C's mean and p99 at least the fp32-triangulated bound at the updated point (`NoiseRule.updated_reference`):
    factor × √(t_u² + (s_0 g)²), t_u the trainer's distance from fp32 there, s_0 the sampler's at the start and g
    = max(1, t_u / t_0) how the trainer's grew (the sampler's own distance after the sync is not used: a wrong
    adapter would widen its own bound)."""
    rule, tri = budgets.noise, budgets.a_triangulation
    t_u, t_0, s_0 = (comparisons.get(k) for k in ("R.trainer_updated_vs_fp32", "R.trainer_vs_fp32",
                                                   "R.sampler_vs_fp32"))
    if rule is None or not rule.updated_reference or tri is None or t_u is None or t_0 is None or s_0 is None:
        return c
    out = dict(c)
    for short, field in STATS[:2]:
        tu, t0, s0 = (float(getattr(x, field)) for x in (t_u, t_0, s_0))
        grow = max(1.0, tu / t0) if t0 > 0 else 1.0
        bound = tri.factor * math.hypot(tu, s0 * grow)
        if bound > out[short].budget:
            out[short] = Threshold(bound, f"{tri.factor:g} x √(trainer {tu:.4g} from fp32 at the updated point² + "
                                          f"(sampler {s0:.4g} at the start x growth {grow:.3g})²), above "
                                          f"{out[short].budget:.4g} ({out[short].note or 'the budget'})")
    return out


def derive(budgets: Budgets, comparisons: Mapping[str, ComparisonStats], deltas: Mapping[str, DeltaStats],
           noise: NoiseModel | None, tails: Mapping[str, Tail] | None = None,
           growth: Growth | None = None, measured_slope: stats.Slope | None = None,
           against_reference: bool = False, batching: float | None = None,
           target_slopes: Mapping[str, stats.Slope | None] | None = None) -> dict[str, Threshold]:
    """Every check's threshold by check id (the checks that may be made; `checks.compute_checks` reads them).
    `tails`: the after-change comparisons' own bulk tails (`own_tails`); `growth`: the start point's
    sequences and the spread of their maxima (`sequence_growth`), for the one-token ceiling;
    `measured_slope`: C.slope's ratio and uncertainty; `batching`: what batching alone moves the updated
    trainer (`batching_l2`), with `NoiseRule.updated_reference` a floor of C.delta's noise."""
    tails = tails or {}
    get = comparisons.get
    a = get("A.trainer_vs_sampler")
    grown = grown_ceiling(budgets, growth)
    triangulated = check_rules.a_parity_thresholds(budgets, get("R.trainer_vs_fp32"), get("R.sampler_vs_fp32"))
    if triangulated is not None and grown is not None:
        triangulated["max"] = grown
    out = _start_point(budgets, triangulated, grown)
    balance = _fp32_balance(budgets, get("R.trainer_vs_fp32"), get("R.sampler_vs_fp32"))
    if balance is not None:
        out["A.fp32.balance"] = balance
    moved = repeat_noise(budgets, comparisons, "sampler")
    for key in ("A.zero_adapter_noop", "A.adapter_moved", "B.withheld", "C.moved.sampler", "C.moved.trainer",
                *engine_state.check_ids(comparisons), *sleep_wake.check_ids(comparisons)):
        out[key] = moved
    fp32_bound = budgets.noise is not None and budgets.noise.mixed_fp32
    out.update({i: mixed_batch.threshold(comparisons, moved, budgets.noise_factor, fp32_bound)
                for i in mixed_batch.check_ids(comparisons)})
    change = get("C.trainer_change")
    out["B.stimulus"] = stimulus(budgets, a, noise, None)
    start_max = triangulated["max"] if triangulated is not None else None
    c = after_change(budgets, a, noise, change, a.n if a is not None else None, tails.get("C.trainer_vs_sampler"),
                     start_max)
    c = _updated_parity(budgets, comparisons, c)
    for short, _ in STATS:
        out[f"C.parity.{short}"] = out[f"P.parity.{short}"] = c[short]
    for prefix in GENERATION_PREFIXES:
        g = _generation(budgets, prefix, comparisons, a, noise, change, c, tails, start_max)
        for short, _ in STATS:
            out[f"{prefix}.parity.{short}"] = g[short]
    use_batching = budgets.noise is not None and budgets.noise.updated_reference
    out.update(_directions(budgets, deltas, noise, moved, batching if use_batching else None))
    out.update(_slopes(budgets, measured_slope, against_reference, target_slopes or {}))
    out["S.trainer_kept"] = repeat_noise(budgets, comparisons, "trainer")
    out["X.sync.identical"] = Threshold(0.0, "bitwise: the sampler repeated the synced adapter's scores exactly")
    out.update({i: Threshold(0.0, exact_reference.NOTE) for i in exact_reference.check_ids(comparisons)})
    if budgets.exact:
        for prefix in EXACT_PREFIXES:
            for short, _ in STATS:
                out[f"{prefix}.{short}"] = Threshold(0.0, "bitwise (--budgets exact): any non-zero difference fails")
    return out


def _start_point(budgets: Budgets, a_thresholds: dict[str, Threshold] | None,
                 grown: Threshold | None = None) -> dict[str, Threshold]:
    """A's parity (`a_thresholds`: against the fp32 reference where scored, else the absolute budgets), the
    fp32 ceilings (the max: `grown`, where it grew for the run's sequences), and the repeat bounds."""
    out: dict[str, Threshold] = {}
    for short, _ in STATS:
        out[f"A.parity.{short}"] = (a_thresholds or _absolute(budgets))[short]
    if budgets.a_triangulation is not None:
        for side in ("trainer", "sampler"):
            for short, _ in STATS:
                out[f"A.fp32.{side}.{short}"] = Threshold(float(getattr(budgets.a_triangulation, short)))
            if grown is not None:
                out[f"A.fp32.{side}.max"] = grown
    for key in ("A.noise.sampler_repeat", "A.noise.trainer_repeat", "C.noise.sampler_repeat"):
        out[key] = Threshold(budgets.repeat_max)
    return out


def _fp32_balance(budgets: Budgets, trainer_fp32: ComparisonStats | None,
                  sampler_fp32: ComparisonStats | None) -> Threshold | None:
    """A.fp32.balance (`budgets.noise.fp32_balance`): the farther side's mean distance from fp32 at most
    factor × the nearer's + the mean budget; None without the rule or the reference."""
    factor = budgets.noise.fp32_balance if budgets.noise is not None else None
    if factor is None or budgets.a_triangulation is None or trainer_fp32 is None or sampler_fp32 is None:
        return None
    nearer = min(trainer_fp32.mean_abs, sampler_fp32.mean_abs)
    return Threshold(factor * nearer + budgets.mean,
                     f"{factor:g} x the nearer side's {nearer:.4g} from fp32 + the mean budget {budgets.mean:g}")


DIRECT = "@direct"
"""Suffix of a triangulated delta check's second threshold, Δsampler against Δtrainer (`NoiseRule.delta_direct`):
in the thresholds `derive` returns, never a check id of its own."""


def _directions(budgets: Budgets, deltas: Mapping[str, DeltaStats], noise: NoiseModel | None,
                moved: Threshold, batching: float | None = None) -> dict[str, Threshold]:
    """C.delta's and every target's direction, scale and rel_l2 thresholds, and T.*.moved; C.delta's noise at
    least `batching` (the updated trainer's own batching noise, measured where C is judged)."""
    noise_l2 = noise.l2 if noise is not None else None
    fixed = delta(budgets, noise_l2, None, noise)  # C.delta's checks are made, not reached, without a C.delta
    out = {"C.delta.cosine": fixed.cosine, "C.delta.scale": fixed.scale, "C.delta.rel_l2": fixed.rel_l2}
    for name, d in deltas.items():
        eps = noise_l2
        if name == "C.delta" and batching is not None and noise_l2 is not None:
            eps = max(noise_l2, batching)
        prefix = name if name == "C.delta" else f"T.{name[len(TARGET_PREFIX):]}"
        if d.reference_to is not None:  # triangulated: Δsampler against Δfp32, the trainer's own distance allowed
            th = delta(budgets, eps, d.reference_norm, noise, d.trainer_rel_l2, d.rel_l2)
            if d.direct_cosine is not None or d.direct_scale is not None:  # and against Δtrainer (delta_direct)
                direct = delta(budgets, eps, d.trainer_norm, noise)
                out[f"{prefix}.cosine{DIRECT}"], out[f"{prefix}.scale{DIRECT}"] = direct.cosine, direct.scale
                out[f"{prefix}.rel_l2{DIRECT}"] = direct.rel_l2
        else:
            th = delta(budgets, eps, d.trainer_norm, noise)
        out[f"{prefix}.cosine"], out[f"{prefix}.scale"], out[f"{prefix}.rel_l2"] = th.cosine, th.scale, th.rel_l2
        if th.trainer is not None:
            out[f"{prefix}.trainer"] = th.trainer
        if prefix.startswith("T."):
            out[f"{prefix}.moved"] = moved
    return out


def _generation(budgets: Budgets, prefix: str, comparisons: Mapping[str, ComparisonStats],
                a: ComparisonStats | None, noise: NoiseModel | None, change: ComparisonStats | None,
                c: dict[str, Threshold], tails: Mapping[str, Tail],
                start_max: Threshold | None = None) -> dict[str, Threshold]:
    """G.*: absolute before the noise rule; with it, C's thresholds, the max's tail predicted for the
    generated tokens' count."""
    if budgets.noise is None:
        return _absolute(budgets)
    key = {"G.sampled": "G.sampled_generation_vs_prompt", "G.updated": "G.updated_generation_vs_prompt",
           "G.trainer": "G.trainer_vs_generation"}[prefix]
    cmp = comparisons.get(key)
    if cmp is None or a is None:
        return c
    return after_change(budgets, a, noise, change, cmp.n, tails.get(key), start_max)


def _absolute(budgets: Budgets) -> dict[str, Threshold]:
    return {short: Threshold(float(getattr(budgets, short))) for short, _ in STATS}
