"""Checks A, B and C, per-target coverage, and the verdict. Pure: scores and budgets in, verdicts out.

The run and `lora-parity verify` both call `evaluate`, so a receipt verifies exactly when its
recorded comparisons, checks and verdict are what its raw scores and budgets give.

Score phases (keys of `scores`): base, zero, zero_repeat, trainer_zero, trainer_zero_repeat,
trainer_updated, stale, updated, updated_repeat, and per target kind K: target.K.trainer,
target.K.sampler; where sampler and trainer share a service (tinker), also stale_after_sync (the
stale adapter queried again after the synced one) and trainer_after_stale (the trainer after
that). With `--reference fp32`, also reference_fp32: the base model scored in fp32 by HF, which
both sides approximate at zero-init (comparisons R.*; with `budgets.a_triangulation` they judge A,
checks A.fp32.*). A sampler that scores through its prefix cache (vllm-server, sglang) also
records stale_cached and updated_cached: the same positions read the way rollouts read them
(comparisons P.*, checks P.parity.*). Where the trainer's tensors can be read (every trainer but
tinker) and the sync publishes an adapter, also fresh: those tensors written by a writer of the
tool's own and loaded under a new name and id (comparison X.synced_vs_fresh, check X.sync.identical); fresh is
recorded empty (no sequence) where the trainer handed no tensors (`handed_nothing`): X then compared nothing.
A comparison `b vs a` looks at b - a.

Check groups (docs/verdicts.md): a check's group follows from its id, `check_rules.group_of`:
numerics = A.parity.*, A.fp32.*, A.noise.*; sync = every other check. `Evaluation.verdicts` gives
each group's verdict; the run's verdict is the worse of the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lora_parity.evidence.receipt import (
    HANDED_NOTHING,
    Budgets,
    Check,
    CheckStatus,
    ComparisonStats,
    DeltaStats,
    NoiseModel,
    ThresholdRecord,
    Verdict,
    Verdicts,
    WorstPosition,
)
from lora_parity.verdict import check_rules, engine_state, exact_reference, stats
from lora_parity.verdict import thresholds as _thresholds
from lora_parity.verdict.change_checks import delta_checks, slope_check
from lora_parity.verdict.deltas import DELTAS as DELTAS  # re-exported: the delta specs live in deltas
from lora_parity.verdict.deltas import TARGET_PREFIX as TARGET_PREFIX
from lora_parity.verdict.deltas import delta_specs, reference_at, update_slopes
from lora_parity.verdict.deltas import target_delta_spec as target_delta_spec
from lora_parity.verdict.deltas import target_kinds as target_kinds

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
    # The fp32 reference at the updated point (the trainer's updated tensors in fp32): each side's distance.
    "R.trainer_updated_vs_fp32": ("reference_fp32_updated", "trainer_updated"),
    "R.sampler_updated_vs_fp32": ("reference_fp32_updated", "updated"),
    # The updated trainer scored a second way (one sequence per call): what batching alone moves.
    "C.trainer_batching": ("trainer_updated", "trainer_updated_alt"),
    "P.stale_cached_vs_stale": ("stale", "stale_cached"),
    "P.trainer_vs_cached": ("updated_cached", "trainer_updated"),
    # Sampled tokens and the generation path after sync (`generation_checks`).
    "G.sampled_generation_vs_prompt": ("zero", "sampled_generation"),
    "G.updated_generation_vs_prompt": ("updated_generation_prompt", "updated_generation"),
    "G.trainer_vs_generation": ("updated_generation", "updated_generation_trainer"),
    # A user's adapter (`--adapter`): it moves the sampler from its base model.
    "A.sampler_base_vs_adapter": ("adapter_base", "zero"),
    # The exact sync check: the synced adapter against the trainer's tensors loaded fresh.
    "X.synced_vs_fresh": ("fresh", "updated"),
    **engine_state.COMPARISONS,
}
@dataclass(frozen=True)
class Evaluation:
    """Everything derived from scores and budgets."""

    comparisons: dict[str, ComparisonStats]
    deltas: dict[str, DeltaStats]
    checks: list[Check]
    verdict: Verdict
    verdicts: Verdicts
    noise: NoiseModel | None = None
    """The noise at the start point every threshold derives from."""
    thresholds: dict[str, ThresholdRecord] | None = None
    """Each check's threshold and its rule, derived before the checks ran."""


def compute_comparisons(
    scores: Mapping[str, Sequence[Sequence[float]]], budgets: Budgets
) -> dict[str, ComparisonStats]:
    """Statistics of every comparison whose two phases were scored."""
    out: dict[str, ComparisonStats] = {}
    for name, (a, b) in COMPARISONS.items():
        if a in scores and b in scores and scores[a] and scores[b]:  # empty: only a fresh phase handed nothing
            out[name] = ComparisonStats(a=a, b=b, **stats.summarize(scores[a], scores[b], over=budgets.mean))  # type: ignore[arg-type]
    return out


def compute_deltas(scores: Mapping[str, Sequence[Sequence[float]]], against_reference: bool = False,
                   direct: bool = False) -> dict[str, DeltaStats]:
    """Delta agreement of C and of every per-target coverage run whose phases were scored; with
    `against_reference` (`NoiseRule.delta_reference`), where the fp32 reference was scored at a change's end
    point, Δsampler against Δfp32 and the trainer's own agreement with it (`DeltaStats.reference_to`)."""
    out: dict[str, DeltaStats] = {}
    for name, (sf, st, tf, tt) in delta_specs(scores).items():
        ref = reference_at(name)
        if against_reference and "reference_fp32" in scores and ref in scores:
            s = stats.delta_agreement(scores[sf], scores[st], scores["reference_fp32"], scores[ref])
            t = stats.delta_agreement(scores[tf], scores[tt], scores["reference_fp32"], scores[ref])
            out[name] = DeltaStats(
                sampler_from=sf, sampler_to=st, trainer_from=tf, trainer_to=tt, cosine=s["cosine"], scale=s["scale"],
                rel_l2=s["rel_l2"], sampler_norm=s["sampler_norm"], trainer_norm=t["sampler_norm"],  # type: ignore[arg-type]
                reference_to=ref, reference_norm=s["trainer_norm"], trainer_cosine=t["cosine"],
                trainer_scale=t["scale"], trainer_rel_l2=t["rel_l2"])
            if direct:  # Δsampler against Δtrainer too (`NoiseRule.delta_direct`)
                d = stats.delta_agreement(scores[sf], scores[st], scores[tf], scores[tt])
                out[name] = out[name].model_copy(update={"direct_cosine": d["cosine"], "direct_scale": d["scale"],
                                                         "direct_rel_l2": d["rel_l2"]})
            continue
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
        n: int | None = None,
        nothing: str | None = None,
    ) -> None:
        """`note` says how a budget derived from measurements was derived; it ends the reason.
        `undecidable` (a reason) makes a reached check inconclusive whatever it observed. `n`: the elements it
        compared (`Check.elements`); a check over none is not run, whatever it observed (`nothing`: why it had none)."""
        if not reached:
            status, reason = CheckStatus.NOT_REACHED, "not reached: the phases it needs did not run"
        elif n == 0:
            status, reason = CheckStatus.NOT_REACHED, "not run: it compared nothing (0 elements)"
            reason = f"{reason}: {nothing}" if nothing else reason
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
            Check(id=id, name=name, status=status, observed=observed, budget=budget, op=op, reason=reason,  # type: ignore[arg-type]
                  elements=n if reached else None)
        )


def _n(cmp: ComparisonStats | None) -> int | None:
    """The elements a comparison compared (its positions), None where it was not made."""
    return cmp.n if cmp is not None else None


def _parity(
    c: _Checker, prefix: str, what: str, cmp: ComparisonStats | None,
    thresholds: Mapping[str, check_rules.Threshold], why: Mapping[str, str] | None = None,
) -> None:
    for short, stat in check_rules.STATS:
        t = thresholds[f"{prefix}.parity.{short}"]
        c.add(f"{prefix}.parity.{short}", f"{what}: {short} |diff| within budget", getattr(cmp, stat) if cmp else None,
              "<=", t.budget, (why or {}).get(short, f"{what} disagree"), reached=cmp is not None, note=t.note,
              n=_n(cmp))


def _check_a_parity(c: _Checker, get: Any, th: Mapping[str, check_rules.Threshold], budgets: Budgets,
                    start: str) -> None:
    """A.parity.*: triangulated against the fp32 reference where it was scored, else absolute; with the
    reference, A.fp32.<side>.* bound each side's distance from fp32."""
    what = f"{start} trainer vs sampler"
    tf, sf = get("R.trainer_vs_fp32"), get("R.sampler_vs_fp32")
    if check_rules.a_parity_thresholds(budgets, tf, sf) is None:
        _parity(c, "A", what, get("A.trainer_vs_sampler"), th)
        return
    why = {short: f"{what} disagree beyond their precision; {check_rules.farther_side(tf, sf, stat)}"
           for short, stat in check_rules.STATS}
    _parity(c, "A", what, get("A.trainer_vs_sampler"), th, why)
    for side, cmp in (("trainer", tf), ("sampler", sf)):
        for short, stat in check_rules.STATS:
            c.add(f"A.fp32.{side}.{short}", f"{side} {start} vs fp32 reference: {short} |diff| within ceiling",
                  getattr(cmp, stat), "<=", th[f"A.fp32.{side}.{short}"].budget, f"the {side} is far from fp32",
                  n=cmp.n)
    if "A.fp32.balance" in th:
        t = th["A.fp32.balance"]
        farther = "sampler" if sf.mean_abs > tf.mean_abs else "trainer"
        c.add("A.fp32.balance", f"{start}: trainer and sampler about equally far from fp32 (mean)",
              max(tf.mean_abs, sf.mean_abs), "<=", t.budget,
              f"the {farther} is much farther from fp32 than the other side (trainer {tf.mean_abs:.4g}, sampler "
              f"{sf.mean_abs:.4g}): more than one precision explains; the two sides start from different adapters "
              "or weights", note=t.note, n=min(tf.n, sf.n))


def compute_checks(
    comparisons: Mapping[str, ComparisonStats], deltas: Mapping[str, DeltaStats], budgets: Budgets,
    thresholds: Mapping[str, check_rules.Threshold] | None = None, noise: NoiseModel | None = None,
    slope: stats.Slope | None = None, target_slopes: Mapping[str, stats.Slope | None] | None = None,
    fresh_empty: bool = False,
) -> list[Check]:
    """Every check, in order A, B, C, per-target, each judged by its threshold in `thresholds`
    (`lora_parity.verdict.thresholds.derive`, computed before from the start point's `noise`; derived here
    from the comparisons alone when not given). `fresh_empty`: the fresh phase was handed nothing (`handed_nothing`)."""
    c = _Checker()
    get = comparisons.get
    th = thresholds if thresholds is not None else _thresholds.derive(budgets, comparisons, deltas, noise)
    # Receipts made before the noise rule name the start point zero-init whatever it was.
    start = noise.start if noise is not None and budgets.noise is not None else "zero-init"

    # A: parity at the start point, and a zero adapter changes nothing on the sampler.
    _check_a_parity(c, get, th, budgets, start)
    for side, key in (("sampler", "A.sampler_repeat"), ("trainer", "A.trainer_repeat")):
        cmp = get(key)
        c.add(f"A.noise.{side}_repeat", f"{side} repeat noise bounded", cmp.max_abs if cmp else None, "<=",
              th[f"A.noise.{side}_repeat"].budget, f"{side} scores the same state differently twice",
              reached=cmp is not None, n=_n(cmp))
    _adapter_noop_check(c, comparisons, th)

    # B: the unpublished update is invisible, and the update is big enough to be caught.
    cmp = get("B.stale_vs_zero")
    c.add("B.withheld", f"sampler: unpublished update invisible (stale = {start})", cmp.max_abs if cmp else None,
          "<=", th["B.withheld"].budget, "unpublished update visible to the sampler", reached=cmp is not None,
          note=th["B.withheld"].note, n=_n(cmp))
    # The noise rule judges the trainer's own change (a frozen trainer shows none, whatever A's noise);
    # receipts made before it judged the updated trainer against the stale sampler.
    own = budgets.noise is not None
    cmp = get("C.trainer_change" if own else "B.trainer_updated_vs_stale")
    c.add("B.stimulus", ("trainer's own change" if own else "updated trainer vs stale sampler") +
          ": missing sync detectable", cmp.mean_abs if cmp else None, ">=", th["B.stimulus"].budget,
          "stimulus too small to detect a missing sync", reached=cmp is not None, failing=CheckStatus.INCONCLUSIVE,
          note=th["B.stimulus"].note, n=_n(cmp))
    no_stimulus = c.checks[-1].status == CheckStatus.INCONCLUSIVE
    # Without a stimulus, "did both sides move the same way" has no answer: inconclusive, not fail.
    moved_failing = CheckStatus.INCONCLUSIVE if no_stimulus else CheckStatus.FAIL

    # C: synced parity, both sides moved, and moved the same way.
    _parity(c, "C", "updated trainer vs synced sampler", get("C.trainer_vs_sampler"), th)
    cmp = get("C.sampler_repeat")
    c.add("C.noise.sampler_repeat", "sampler repeat noise bounded after sync", cmp.max_abs if cmp else None, "<=",
          th["C.noise.sampler_repeat"].budget, "sampler scores the synced adapter differently twice",
          reached=cmp is not None, n=_n(cmp))
    for side, key in (("sampler", "C.sampler_change"), ("trainer", "C.trainer_change")):
        cmp = get(key)
        c.add(f"C.moved.{side}", f"{side} changed from {start} to updated (above noise)",
              cmp.mean_abs if cmp else None, ">", th[f"C.moved.{side}"].budget, f"{side} did not move",
              reached=cmp is not None, failing=moved_failing, note=th[f"C.moved.{side}"].note, n=_n(cmp))
    tokens = _n(get("C.trainer_change"))  # every delta is over the probe positions
    delta_checks(c, "C.delta", deltas.get("C.delta"), th, moved_failing, n=tokens)
    if "C.slope" in th:
        runs = sum(1 for name in deltas if name == "C.delta" or name.startswith(TARGET_PREFIX))
        slope_check(c, slope, th["C.slope"], "C.delta" in deltas, moved_failing,
                     n=tokens * runs if tokens is not None else None)

    _exact_sync_check(c, get("X.synced_vs_fresh"), get("C.sampler_repeat"), th, fresh_empty)
    exact_reference.add_checks(c, comparisons)
    engine_state.add_checks(c, comparisons, th)

    # Per-target coverage: each target kind alone reaches the sampler with the right sign and scale.
    noise_l2 = noise.l2 if noise is not None else None
    for name, delta in deltas.items():
        if not name.startswith(TARGET_PREFIX):
            continue
        kind = name[len(TARGET_PREFIX) :]
        c.add(f"T.{kind}.moved", f"target {kind}: sampler moved when only {kind} was updated",
              delta.sampler_norm, ">", th[f"T.{kind}.moved"].budget, f"target {kind} does not reach the sampler",
              note=th[f"T.{kind}.moved"].note, n=tokens)
        snr, why = budgets.min_target_snr, None
        if snr is not None and noise_l2 is not None and delta.trainer_norm < snr * noise_l2:
            why = (f"target {kind}'s own effect (‖Δtrainer‖ {delta.trainer_norm:.3g}) is below {snr:g}x the "
                   f"{start} disagreement ({noise_l2:.3g}), so its direction is lost in the noise")
        if "@" not in kind:  # a per-layer run is judged by its slope alone (`layer_coverage`)
            delta_checks(c, f"T.{kind}", delta, th, CheckStatus.FAIL if why is None else CheckStatus.INCONCLUSIVE,
                          rel_l2=False, why=why, n=tokens)
        if f"T.{kind}.slope" in th:
            slope_check(c, (target_slopes or {}).get(name), th[f"T.{kind}.slope"], True, CheckStatus.FAIL,
                         f"T.{kind}.slope", f"target {kind}", n=tokens)

    # S: querying the old sampling client again leaves the trainer's weights alone. Only where
    # those phases were scored (samplers that share the trainer's service); absent elsewhere.
    kept = get("S.trainer_after_stale_vs_updated")
    if kept is not None:
        trainer_noise = th["S.trainer_kept"].budget
        back = get("S.trainer_after_stale_vs_zero")
        reverted = back is not None and back.max_abs <= trainer_noise
        c.add("S.trainer_kept", "trainer keeps its update after the old sampling client is queried again",
              kept.max_abs, "<=", trainer_noise,
              f"querying an old sampling client {'reverted' if reverted else 'changed'} the trainer's weights",
              note=th["S.trainer_kept"].note, n=kept.n)
    _prefix_cache_checks(c, get("P.trainer_vs_cached"), th)
    generation_checks(c, comparisons, th)
    return c.checks


def handed_nothing(scores: Mapping[str, Sequence[Sequence[float]]]) -> bool:
    """The fresh phase was recorded empty: the trainer handed X no LoRA tensors, so no fresh adapter was loaded
    or scored (`phases.Run.fresh`); the only score array that may be empty (`verify`)."""
    return "fresh" in scores and len(scores["fresh"]) == 0


def _exact_sync_check(c: _Checker, fresh: ComparisonStats | None, repeat: ComparisonStats | None,
                      thresholds: Mapping[str, check_rules.Threshold], empty: bool = False) -> None:
    """X: the synced adapter scores bit for bit as the trainer's tensors loaded fresh (`fresh` phase),
    where the sampler scored the synced adapter bit for bit the same twice. Needs no noise model: a
    deterministic engine given the same tensors gives the same numbers. Absent where the fresh load was
    not scored, or the sampler does not repeat itself exactly; not run (0 elements) where the fresh phase
    was handed no tensors (`empty`), whatever the sampler: a comparison over nothing never reads as verified."""
    what, t = "synced sampler = the trainer's tensors loaded fresh, bit for bit", thresholds["X.sync.identical"]
    why = ("the synced adapter is not the trainer's: its tensors, written independently and loaded under a new name "
           "and id, score differently")
    if empty:
        c.add("X.sync.identical", what, None, "<=", t.budget, why, n=0, nothing=HANDED_NOTHING)
    elif fresh is not None and repeat is not None and repeat.max_abs == 0:
        c.add("X.sync.identical", what, fresh.max_abs, "<=", t.budget, why, note=t.note, n=fresh.n)


def _prefix_cache_checks(c: _Checker, cached: ComparisonStats | None,
                         thresholds: Mapping[str, check_rules.Threshold]) -> None:
    """P: the synced sampler read through its prefix cache matches the updated trainer (no KV block
    computed with the old adapter serves the new one), judged as C is. Only where those phases were scored."""
    if cached is not None:
        _parity(c, "P", "updated trainer vs synced sampler read through the prefix cache", cached, thresholds)


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
    """Comparisons, deltas, the noise model and every threshold (derived first, as data), then the
    checks and the verdict, from raw scores and budgets."""
    comparisons = compute_comparisons(scores, budgets) | exact_reference.comparisons(scores, budgets)
    rule = budgets.noise
    deltas = compute_deltas(scores, rule is not None and rule.delta_reference, rule is not None and rule.delta_direct)
    noise = _thresholds.noise_model(scores, comparisons)
    after = {k: COMPARISONS[k] for k in ("C.trainer_vs_sampler", *(key for key, _ in GENERATION_PARITY.values()))}
    slope, each, against_reference = update_slopes(scores)
    derived = _thresholds.derive(budgets, comparisons, deltas, noise, _thresholds.own_tails(scores, after),
                                 _thresholds.sequence_growth(scores), slope, against_reference,
                                 _thresholds.batching_l2(scores), each)
    checks = compute_checks(comparisons, deltas, budgets, derived, noise, slope, each, handed_nothing(scores))
    if rule is None:
        moved = frozenset[str]()
    elif rule.x_proves_delivery and check_rules.delivered(checks):
        moved = check_rules.computation_checks(checks)
    else:
        moved = check_rules.tails_in_numerics(checks)
    verdicts = check_rules.group_verdicts(checks, errored, moved)
    recorded = {ch.id: ThresholdRecord(budget=derived[ch.id].budget, rule=derived[ch.id].note or "the budget",
                                       undecidable=derived[ch.id].undecidable) for ch in checks}
    return Evaluation(comparisons, deltas, checks, check_rules.combined(verdicts), verdicts, noise, recorded)


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
        if a in scores and b in scores and scores[a] and scores[b]:
            out[name] = [WorstPosition(**w) for w in stats.worst_positions(scores[a], scores[b], sequences, k)]  # type: ignore[arg-type]
    return out


GENERATION_PARITY = {
    "G.sampled": ("G.sampled_generation_vs_prompt", "sampler: generation logprobs vs prompt logprobs (zero-init)"),
    "G.updated": ("G.updated_generation_vs_prompt", "sampler: generation logprobs vs prompt logprobs (synced)"),
    "G.trainer": ("G.trainer_vs_generation", "updated trainer vs synced sampler's rollout logprobs"),
}
"""Check prefix -> (comparison, what it compares) of the generation path (`--probes sampled`)."""


def generation_checks(c: _Checker, comparisons: Mapping[str, ComparisonStats],
                      thresholds: Mapping[str, check_rules.Threshold]) -> None:
    """Parity (mean, p99, max) of each generation-path comparison that was recorded; none for a run
    that sampled nothing, so receipts without those scores keep their checks."""
    for prefix, (key, what) in GENERATION_PARITY.items():
        if key in comparisons:
            _parity(c, prefix, what, comparisons[key], thresholds)


def _adapter_noop_check(c: _Checker, comparisons: Mapping[str, ComparisonStats],
                        thresholds: Mapping[str, check_rules.Threshold]) -> None:
    """A.zero_adapter_noop: the zero-init adapter changes nothing on the sampler. With a user's adapter
    (`--adapter`, comparison A.sampler_base_vs_adapter recorded) it gives way to A.adapter_moved: the
    adapter moved the sampler from its base model (above noise)."""
    moved = comparisons.get("A.sampler_base_vs_adapter")
    if moved is not None:
        t = thresholds["A.adapter_moved"]
        c.add("A.adapter_moved", "sampler: the starting adapter moves it from the base model", moved.mean_abs, ">",
              t.budget, "the starting adapter does not change the sampler's scores", note=t.note, n=moved.n)
        return
    cmp = comparisons.get("A.sampler_base_vs_zero")
    t = thresholds["A.zero_adapter_noop"]
    c.add("A.zero_adapter_noop", "sampler: zero-init adapter changes nothing vs base", cmp.max_abs if cmp else None,
          "<=", t.budget, "the zero-init adapter changes the sampler's scores", reached=cmp is not None, note=t.note,
          n=_n(cmp))
