"""Checks A, B and C, per-target coverage, and the verdict. Pure: scores and budgets in, verdicts out.

The run and `lora-parity verify` both call `evaluate`, so a receipt verifies exactly when its
recorded comparisons, checks and verdict are what its raw scores and budgets give.

Score phases (keys of `scores`): base, zero, zero_repeat, trainer_zero, trainer_zero_repeat,
trainer_updated, stale, updated, updated_repeat, and per target kind K: target.K.trainer,
target.K.sampler; where sampler and trainer share a service (tinker), also stale_after_sync (the
stale adapter queried again after the synced one) and trainer_after_stale (the trainer after
that). With `--reference fp32`, also reference_fp32: the base model scored in fp32 by HF, which
both sides approximate at zero-init (comparisons R.*; with `budgets.a_triangulation` they judge A,
checks A.fp32.*). A sampler that scores through its prefix cache (vllm-server) also
records stale_cached and updated_cached: the same positions read the way rollouts read them
(comparisons P.*, checks P.parity.*). A comparison `b vs a` looks at b - a.

Check groups (docs/verdicts.md): a check's group follows from its id, `check_rules.group_of`:
numerics = A.parity.*, A.fp32.*, A.noise.*; sync = every other check. `Evaluation.verdicts` gives
each group's verdict; the run's verdict is the worse of the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_parity import check_rules, stats
from lora_parity.receipt import (
    Budgets,
    Check,
    CheckStatus,
    ComparisonStats,
    DeltaStats,
    Verdict,
    Verdicts,
    WorstPosition,
)

# name -> (a, b): statistics of scores[b] - scores[a].
COMPARISONS: dict[str, tuple[str, str]] = {
    "A.trainer_vs_sampler": ("zero", "trainer_zero"),
    "A.sampler_base_vs_zero": ("base", "zero"),
    "A.sampler_repeat": ("zero", "zero_repeat"),
    "A.trainer_repeat": ("trainer_zero", "trainer_zero_repeat"),
    "B.stale_vs_zero": ("zero_repeat", "stale"),
    "B.trainer_updated_vs_stale": ("stale", "trainer_updated"),
    "C.trainer_vs_sampler": ("updated", "trainer_updated"),
    "C.sampler_repeat": ("updated", "updated_repeat"),
    "C.sampler_change": ("zero", "updated"),
    "C.trainer_change": ("trainer_zero", "trainer_updated"),
    "S.trainer_after_stale_vs_updated": ("trainer_updated", "trainer_after_stale"),
    "S.trainer_after_stale_vs_zero": ("trainer_zero", "trainer_after_stale"),
    "S.stale_after_sync_vs_zero": ("zero", "stale_after_sync"),
    "R.trainer_vs_fp32": ("reference_fp32", "trainer_zero"),
    "R.sampler_vs_fp32": ("reference_fp32", "zero"),
    "P.stale_cached_vs_stale": ("stale", "stale_cached"),
    "P.trainer_vs_cached": ("updated_cached", "trainer_updated"),
    # Sampled tokens and the generation path after sync (`generation_checks`).
    "G.sampled_generation_vs_prompt": ("zero", "sampled_generation"),
    "G.updated_generation_vs_prompt": ("updated_generation_prompt", "updated_generation"),
    "G.trainer_vs_generation": ("updated_generation", "updated_generation_trainer"),
    # A user's adapter (`--adapter`): it moves the sampler from its base model.
    "A.sampler_base_vs_adapter": ("adapter_base", "zero"),
}
# name -> (sampler_from, sampler_to, trainer_from, trainer_to)
DELTAS: dict[str, tuple[str, str, str, str]] = {
    "C.delta": ("zero", "updated", "trainer_zero", "trainer_updated"),
}
TARGET_PREFIX = "target."


def target_kinds(scores: Mapping[str, object]) -> list[str]:
    """Target kinds with both per-target score arrays present, in first-seen order."""
    kinds: list[str] = []
    for key in scores:
        if key.startswith(TARGET_PREFIX) and key.endswith(".sampler"):
            kind = key[len(TARGET_PREFIX) : -len(".sampler")]
            if f"{TARGET_PREFIX}{kind}.trainer" in scores and kind not in kinds:
                kinds.append(kind)
    return kinds


def target_delta_spec(kind: str) -> tuple[str, str, str, str]:
    """Delta definition of one target kind's coverage run: both sides from zero-init to that kind perturbed."""
    return ("zero", f"{TARGET_PREFIX}{kind}.sampler", "trainer_zero", f"{TARGET_PREFIX}{kind}.trainer")


@dataclass(frozen=True)
class Evaluation:
    """Everything derived from scores and budgets."""

    comparisons: dict[str, ComparisonStats]
    deltas: dict[str, DeltaStats]
    checks: list[Check]
    verdict: Verdict
    verdicts: Verdicts


def compute_comparisons(
    scores: Mapping[str, Sequence[Sequence[float]]], budgets: Budgets
) -> dict[str, ComparisonStats]:
    """Statistics of every comparison whose two phases were scored."""
    out: dict[str, ComparisonStats] = {}
    for name, (a, b) in COMPARISONS.items():
        if a in scores and b in scores:
            out[name] = ComparisonStats(a=a, b=b, **stats.summarize(scores[a], scores[b], over=budgets.mean))  # type: ignore[arg-type]
    return out


def compute_deltas(scores: Mapping[str, Sequence[Sequence[float]]]) -> dict[str, DeltaStats]:
    """Delta agreement of C and of every per-target coverage run whose phases were scored."""
    specs = dict(DELTAS)
    for kind in target_kinds(scores):
        specs[f"{TARGET_PREFIX}{kind}"] = target_delta_spec(kind)
    out: dict[str, DeltaStats] = {}
    for name, (sf, st, tf, tt) in specs.items():
        if all(p in scores for p in (sf, st, tf, tt)):
            d = stats.delta_agreement(scores[sf], scores[st], scores[tf], scores[tt])
            out[name] = DeltaStats(sampler_from=sf, sampler_to=st, trainer_from=tf, trainer_to=tt, **d)  # type: ignore[arg-type]
    return out


class _Checker:
    """Accumulates checks; a missing observation makes a check `not_reached`."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def add(
        self,
        id: str,
        name: str,
        observed: float | None,
        op: str,
        budget: float,
        fail_reason: str,
        *,
        reached: bool = True,
        failing: CheckStatus = CheckStatus.FAIL,
        note: str | None = None,
        undecidable: str | None = None,
    ) -> None:
        """`note` says how a budget derived from measurements was derived; it ends the reason.
        `undecidable` (a reason) makes a reached check inconclusive whatever it observed."""
        if not reached:
            status, reason = CheckStatus.NOT_REACHED, "not reached: the phases it needs did not run"
        elif observed is None:
            status, reason = failing, f"{fail_reason} (undefined: no change to compare)"
        else:
            ok = {"<=": observed <= budget, ">=": observed >= budget, ">": observed > budget}[op]
            status = CheckStatus.PASS if ok else failing
            verdict = f"{observed:.4g} {op} {budget:.4g}"
            reason = verdict if ok else f"{fail_reason}: {observed:.4g} not {op} {budget:.4g}"
            if undecidable is not None:
                status, reason = CheckStatus.INCONCLUSIVE, f"{undecidable}: {verdict}"
            reason = f"{reason} ({note})" if note else reason
        self.checks.append(
            Check(id=id, name=name, status=status, observed=observed, budget=budget, op=op, reason=reason)  # type: ignore[arg-type]
        )


def _parity(
    c: _Checker, prefix: str, what: str, cmp: ComparisonStats | None,
    thresholds: Mapping[str, check_rules.Threshold], why: Mapping[str, str] | None = None,
) -> None:
    for short, stat in check_rules.STATS:
        t = thresholds[short]
        c.add(f"{prefix}.parity.{short}", f"{what}: {short} |diff| within budget", getattr(cmp, stat) if cmp else None,
              "<=", t.budget, (why or {}).get(short, f"{what} disagree"), reached=cmp is not None, note=t.note)


def _absolute(budgets: Budgets) -> dict[str, check_rules.Threshold]:
    return {short: check_rules.Threshold(float(getattr(budgets, short))) for short, _ in check_rules.STATS}


def _check_a_parity(c: _Checker, get: Any, budgets: Budgets) -> None:
    """A.parity.*: triangulated against the fp32 reference where it was scored, else absolute; with the
    reference, A.fp32.<side>.* bound each side's distance from fp32."""
    what = "zero-init trainer vs sampler"
    tf, sf = get("R.trainer_vs_fp32"), get("R.sampler_vs_fp32")
    thresholds = check_rules.a_parity_thresholds(budgets, tf, sf)
    if thresholds is None:
        _parity(c, "A", what, get("A.trainer_vs_sampler"), _absolute(budgets))
        return
    why = {short: f"{what} disagree beyond their precision; {check_rules.farther_side(tf, sf, stat)}"
           for short, stat in check_rules.STATS}
    _parity(c, "A", what, get("A.trainer_vs_sampler"), thresholds, why)
    tri = budgets.a_triangulation
    assert tri is not None
    for side, cmp in (("trainer", tf), ("sampler", sf)):
        for short, stat in check_rules.STATS:
            c.add(f"A.fp32.{side}.{short}", f"{side} zero-init vs fp32 reference: {short} |diff| within ceiling",
                  getattr(cmp, stat), "<=", float(getattr(tri, short)), f"the {side} is far from fp32")


def compute_checks(
    comparisons: Mapping[str, ComparisonStats], deltas: Mapping[str, DeltaStats], budgets: Budgets,
    zero_init_l2: float | None = None,
) -> list[Check]:
    """Every check, in order A, B, C, per-target. `zero_init_l2` is ‖trainer_zero - zero‖ (L2 over all
    positions), the noise per-target direction is judged against (`budgets.min_target_snr`)."""
    c = _Checker()
    get = comparisons.get

    # A: zero-init parity, and a zero adapter changes nothing on the sampler.
    _check_a_parity(c, get, budgets)
    for side, key in (("sampler", "A.sampler_repeat"), ("trainer", "A.trainer_repeat")):
        cmp = get(key)
        c.add(f"A.noise.{side}_repeat", f"{side} repeat noise bounded", cmp.max_abs if cmp else None, "<=",
              budgets.repeat_max, f"{side} scores the same state differently twice", reached=cmp is not None)
    repeat = get("A.sampler_repeat")
    noise = max(budgets.noise_factor * repeat.max_abs, budgets.noise_floor) if repeat else budgets.noise_floor
    _adapter_noop_check(c, comparisons, noise)

    # B: the unpublished update is invisible, and the update is big enough to be caught.
    cmp = get("B.stale_vs_zero")
    c.add("B.withheld", "sampler: unpublished update invisible (stale = zero-init)", cmp.max_abs if cmp else None,
          "<=", noise, "unpublished update visible to the sampler", reached=cmp is not None)
    cmp = get("B.trainer_updated_vs_stale")
    c.add("B.stimulus", "updated trainer vs stale sampler: missing sync detectable", cmp.mean_abs if cmp else None,
          ">=", budgets.min_stimulus, "stimulus too small to detect a missing sync",
          reached=cmp is not None, failing=CheckStatus.INCONCLUSIVE)
    no_stimulus = c.checks[-1].status == CheckStatus.INCONCLUSIVE
    # Without a stimulus, "did both sides move the same way" has no answer: inconclusive, not fail.
    moved_failing = CheckStatus.INCONCLUSIVE if no_stimulus else CheckStatus.FAIL

    # C: synced parity, both sides moved, and moved the same way.
    _parity(c, "C", "updated trainer vs synced sampler", get("C.trainer_vs_sampler"),
            check_rules.c_parity_thresholds(budgets, get("A.trainer_vs_sampler")))
    cmp = get("C.sampler_repeat")
    c.add("C.noise.sampler_repeat", "sampler repeat noise bounded after sync", cmp.max_abs if cmp else None, "<=",
          budgets.repeat_max, "sampler scores the synced adapter differently twice", reached=cmp is not None)
    for side, key in (("sampler", "C.sampler_change"), ("trainer", "C.trainer_change")):
        cmp = get(key)
        c.add(f"C.moved.{side}", f"{side} changed from zero-init to updated (above noise)",
              cmp.mean_abs if cmp else None, ">", noise, f"{side} did not move", reached=cmp is not None,
              failing=moved_failing)
    _delta_checks(c, "C.delta", deltas.get("C.delta"), budgets, moved_failing, zero_init_l2=zero_init_l2)

    # Per-target coverage: each target kind alone reaches the sampler with the right sign and scale.
    for name, delta in deltas.items():
        if not name.startswith(TARGET_PREFIX):
            continue
        kind = name[len(TARGET_PREFIX) :]
        c.add(f"T.{kind}.moved", f"target {kind}: sampler moved when only {kind} was updated",
              delta.sampler_norm, ">", noise, f"target {kind} does not reach the sampler")
        snr, why = budgets.min_target_snr, None
        if snr is not None and zero_init_l2 is not None and delta.trainer_norm < snr * zero_init_l2:
            why = (f"target {kind}'s own effect (‖Δtrainer‖ {delta.trainer_norm:.3g}) is below {snr:g}x the "
                   f"zero-init disagreement ({zero_init_l2:.3g}), so its direction is lost in the noise")
        _delta_checks(c, f"T.{kind}", delta, budgets, CheckStatus.FAIL if why is None else CheckStatus.INCONCLUSIVE,
                      rel_l2=False, why=why, zero_init_l2=zero_init_l2)

    # S: querying the old sampling client again leaves the trainer's weights alone. Only where
    # those phases were scored (samplers that share the trainer's service); absent elsewhere.
    kept = get("S.trainer_after_stale_vs_updated")
    if kept is not None:
        repeat = get("A.trainer_repeat")
        trainer_noise = budgets.noise_floor
        if repeat is not None:
            trainer_noise = max(budgets.noise_factor * repeat.max_abs, budgets.noise_floor)
        back = get("S.trainer_after_stale_vs_zero")
        reverted = back is not None and back.max_abs <= trainer_noise
        c.add("S.trainer_kept", "trainer keeps its update after the old sampling client is queried again",
              kept.max_abs, "<=", trainer_noise,
              f"querying an old sampling client {'reverted' if reverted else 'changed'} the trainer's weights")
    c_thresholds = check_rules.c_parity_thresholds(budgets, get("A.trainer_vs_sampler"))
    _prefix_cache_checks(c, get("P.trainer_vs_cached"), c_thresholds)
    generation_checks(c, comparisons, budgets)
    return c.checks


def _prefix_cache_checks(c: _Checker, cached: ComparisonStats | None,
                         thresholds: Mapping[str, check_rules.Threshold]) -> None:
    """P: the synced sampler read through its prefix cache matches the updated trainer (no KV block
    computed with the old adapter serves the new one), judged as C is. Only where those phases were scored."""
    if cached is not None:
        _parity(c, "P", "updated trainer vs synced sampler read through the prefix cache", cached, thresholds)


def _delta_checks(
    c: _Checker, prefix: str, delta: DeltaStats | None, budgets: Budgets, failing: CheckStatus, rel_l2: bool = True,
    why: str | None = None, zero_init_l2: float | None = None,
) -> None:
    """Direction, scale (and rel_l2) of Δsampler vs Δtrainer; `why` replaces the failure reason. The
    thresholds are loosened to what the zero-init noise explains (`check_rules.delta_thresholds`)."""
    reached = delta is not None
    th = check_rules.delta_thresholds(budgets, zero_init_l2, delta.trainer_norm if delta else None)
    undecidable = "noise as large as the change explains any direction and scale" if th.undecidable else None
    c.add(f"{prefix}.cosine", "Δsampler points the same way as Δtrainer", delta.cosine if delta else None, ">=",
          th.cosine.budget, why or "sampler moved in another direction", reached=reached, failing=failing,
          note=th.cosine.note, undecidable=undecidable)
    scale_err = abs(delta.scale - 1) if delta and delta.scale is not None else None
    c.add(f"{prefix}.scale", "|‖Δsampler‖/‖Δtrainer‖ - 1| within budget", scale_err, "<=",
          th.scale.budget, why or "sampler moved by another amount", reached=reached, failing=failing,
          note=th.scale.note, undecidable=undecidable)
    if rel_l2:
        c.add(f"{prefix}.rel_l2", "‖Δsampler - Δtrainer‖/‖Δtrainer‖ within budget", delta.rel_l2 if delta else None,
              "<=", th.rel_l2.budget, "sampler's change differs from trainer's", reached=reached,
              failing=failing, note=th.rel_l2.note, undecidable=undecidable)


def verdict_of(checks: Sequence[Check], errored: bool) -> Verdict:
    """error if the run errored; else fail if any check failed; else inconclusive if any check was
    inconclusive or not reached; else pass."""
    if errored:
        return Verdict.ERROR
    statuses = {ch.status for ch in checks}
    if CheckStatus.FAIL in statuses:
        return Verdict.FAIL
    if statuses & {CheckStatus.INCONCLUSIVE, CheckStatus.NOT_REACHED} or not checks:
        return Verdict.INCONCLUSIVE
    return Verdict.PASS


def evaluate(scores: Mapping[str, Sequence[Sequence[float]]], budgets: Budgets, errored: bool) -> Evaluation:
    """Comparisons, deltas, checks and verdict from raw scores and budgets."""
    comparisons = compute_comparisons(scores, budgets)
    deltas = compute_deltas(scores)
    zero_init_l2 = None
    if "trainer_zero" in scores and "zero" in scores:
        zero_init_l2 = stats.l2(stats.differences(scores["trainer_zero"], scores["zero"]))
    checks = compute_checks(comparisons, deltas, budgets, zero_init_l2)
    verdicts = check_rules.group_verdicts(checks, errored)
    return Evaluation(comparisons, deltas, checks, check_rules.combined(verdicts), verdicts)


def not_passing(checks: Iterable[Check], *, reached: bool = False) -> list[Check]:
    """The checks whose status is not pass (fail, inconclusive, not reached), in order; with
    `reached=True`, only those that were reached (fail, inconclusive)."""
    skip = {CheckStatus.PASS, CheckStatus.NOT_REACHED} if reached else {CheckStatus.PASS}
    return [ch for ch in checks if ch.status not in skip]


WORST_K = 5
"""Worst positions kept per comparison in a receipt."""


def compute_worst_positions(
    scores: Mapping[str, Sequence[Sequence[float]]], sequences: Sequence[Sequence[int]], k: int = WORST_K
) -> dict[str, list[WorstPosition]]:
    """Per comparison whose two phases were scored, its `k` largest-|diff| positions (see
    `stats.worst_positions`); the run records them and `lora-parity verify` recomputes them."""
    out: dict[str, list[WorstPosition]] = {}
    for name, (a, b) in COMPARISONS.items():
        if a in scores and b in scores:
            out[name] = [WorstPosition(**w) for w in stats.worst_positions(scores[a], scores[b], sequences, k)]  # type: ignore[arg-type]
    return out


GENERATION_PARITY = {
    "G.sampled": ("G.sampled_generation_vs_prompt", "sampler: generation logprobs vs prompt logprobs (zero-init)"),
    "G.updated": ("G.updated_generation_vs_prompt", "sampler: generation logprobs vs prompt logprobs (synced)"),
    "G.trainer": ("G.trainer_vs_generation", "updated trainer vs synced sampler's rollout logprobs"),
}
"""Check prefix -> (comparison, what it compares) of the generation path (`--probes sampled`)."""


def generation_checks(c: _Checker, comparisons: Mapping[str, ComparisonStats], budgets: Budgets) -> None:
    """Parity (mean, p99, max) of each generation-path comparison that was recorded; none for a run
    that sampled nothing, so receipts without those scores keep their checks."""
    for prefix, (key, what) in GENERATION_PARITY.items():
        if key in comparisons:
            _parity(c, prefix, what, comparisons[key], _absolute(budgets))


def _adapter_noop_check(c: _Checker, comparisons: Mapping[str, ComparisonStats], noise: float) -> None:
    """A.zero_adapter_noop: the zero-init adapter changes nothing on the sampler. With a user's adapter
    (`--adapter`, comparison A.sampler_base_vs_adapter recorded) it gives way to A.adapter_moved: the
    adapter moved the sampler from its base model (above noise)."""
    moved = comparisons.get("A.sampler_base_vs_adapter")
    if moved is not None:
        c.add("A.adapter_moved", "sampler: the starting adapter moves it from the base model", moved.mean_abs, ">",
              noise, "the starting adapter does not change the sampler's scores")
        return
    cmp = comparisons.get("A.sampler_base_vs_zero")
    c.add("A.zero_adapter_noop", "sampler: zero-init adapter changes nothing vs base", cmp.max_abs if cmp else None,
          "<=", noise, "the zero-init adapter changes the sampler's scores", reached=cmp is not None)
