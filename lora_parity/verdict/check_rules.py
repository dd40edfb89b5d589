"""The budget rules that depend on what was measured, and the two verdicts (see docs/verdicts.md).

Pure: numbers in, thresholds and verdicts out; `checks.compute_checks` applies them.

- C relative to A: C's parity budgets are factor × A's observed statistic + floor.
- A triangulated: with the fp32 reference scored, A's mean and p99 may be factor × the larger
  side's distance from fp32, and each side stays under absolute ceilings.
- Noise-derived delta thresholds: noise of norm kε moves a change of norm |t| by an angle of at most
  asin(kε/|t|) and its length by at most kε, so a cosine or scale error noise alone explains is not a
  failure.
- Groups: numerics (A.parity.*, A.fp32.*, A.noise.*) and sync (every other check).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lora_parity.evidence.receipt import Budgets, Check, CheckStatus, ComparisonStats, GroupVerdict, Verdict, Verdicts

STATS = (("mean", "mean_abs"), ("p99", "p99"), ("max", "max_abs"))
"""(check suffix, ComparisonStats field) of the three parity statistics."""

NUMERICS_PREFIXES = ("A.parity.", "A.fp32.", "A.noise.")
"""Check ids that start with one of these are in the numerics group; every other check is sync."""


@dataclass(frozen=True)
class Threshold:
    """A budget and, where it was derived from measurements, how (for the check's reason)."""

    budget: float
    note: str | None = None
    undecidable: bool = False
    """Noise explains any outcome (a delta whose noise is as large as its change): inconclusive."""


def target_of(check_id: str) -> str:
    """The target of a per-target check `T.K.stat` (K may hold dots: `experts.down_proj`, `down_proj@3-5`); ''
    for another check."""
    return check_id[2:].rpartition(".")[0] if check_id.startswith("T.") else ""


def group_of(check_id: str) -> str:
    """'numerics' for A's parity, fp32 and repeat-noise checks and the trainer's own change against fp32's
    (C.delta.trainer, T.K.trainer: never a delivery question), else 'sync'."""
    trainer_own = check_id.endswith(".trainer") and check_id.startswith(("C.delta.", "T."))
    return "numerics" if check_id.startswith(NUMERICS_PREFIXES) or trainer_own else "sync"


def compared_nothing(check: Check) -> bool:
    """The check was not run because it was handed an empty set (0 elements), not because its phases did not run."""
    return check.status == CheckStatus.NOT_REACHED and check.elements == 0


def _group_verdict(checks: Sequence[Check], errored: bool) -> GroupVerdict:
    if errored:
        return GroupVerdict(verdict=Verdict.ERROR, decided_by=[])
    failed = [c.id for c in checks if c.status == CheckStatus.FAIL]
    if failed:
        return GroupVerdict(verdict=Verdict.FAIL, decided_by=failed)
    open_ = [c.id for c in checks if c.status in (CheckStatus.INCONCLUSIVE, CheckStatus.NOT_REACHED)]
    if open_ or not checks:
        return GroupVerdict(verdict=Verdict.INCONCLUSIVE, decided_by=open_)
    return GroupVerdict(verdict=Verdict.PASS, decided_by=[c.id for c in checks])


TAIL_IDS = ("C.parity.p99", "C.parity.max")
"""C's tail checks: numerics, not sync, where the rest of C shows the sync worked (`tails_in_numerics`)."""


def tails_in_numerics(checks: Sequence[Check]) -> frozenset[str]:
    """The C tail checks that belong to numerics in this run: where C's mean passed, the sampler moved and
    every C.delta check passed, the sync evidently worked and a tail beyond the predicted one is numerics
    (a few tokens computed differently), not sync. Under the noise rule only (`evaluate`)."""
    status = {c.id: c.status for c in checks}
    evidence = ["C.parity.mean", "C.moved.sampler"] + [i for i in status if i.startswith("C.delta.")]
    if all(status.get(i) == CheckStatus.PASS for i in evidence):
        return frozenset(i for i in TAIL_IDS if i in status)
    return frozenset()


DELIVERY_EVIDENCE = ("X.sync.identical", "B.withheld", "C.moved.sampler")
"""Delivery proven (`NoiseRule.x_proves_delivery`): the engine served the trainer's tensors bit for bit after
the sync (X), not before it (B.withheld), and its scores moved (C.moved.sampler)."""
COMPUTATION_PREFIXES = ("C.parity.", "C.delta.", "C.slope", "G.trainer.")
COMPUTATION_SUFFIXES = (".cosine", ".scale", ".rel_l2", ".slope")
"""What the two sides compute with the same tensors: C's parity, direction, scale and slope, the trainer against
the rollout logprobs, and each target's direction and scale (T.K.cosine, .scale)."""


def delivered(checks: Sequence[Check]) -> bool:
    """Every check of `DELIVERY_EVIDENCE` ran and passed, and no exact reference check (E.*) failed: the engine
    parting from its own operations with the trainer's tensors is stronger evidence than X's fresh load."""
    status = {c.id: c.status for c in checks}
    exact_failed = any(c.id.startswith("E.") and c.status == CheckStatus.FAIL for c in checks)
    return all(status.get(i) == CheckStatus.PASS for i in DELIVERY_EVIDENCE) and not exact_failed


def computation_checks(checks: Sequence[Check]) -> frozenset[str]:
    """Where delivery is proven (`delivered`), the checks that judge the computation (the numerics verdict)."""
    return frozenset(c.id for c in checks if c.id.startswith(COMPUTATION_PREFIXES)
                     or (c.id.startswith("T.") and c.id.endswith(COMPUTATION_SUFFIXES)))


def group_verdicts(checks: Sequence[Check], errored: bool, numerics_tails: frozenset[str] = frozenset()) -> Verdicts:
    """The sync and numerics verdicts of `checks` (`group_of` splits them; the ids in `numerics_tails`
    are numerics, `tails_in_numerics`)."""
    sync = [c for c in checks if group_of(c.id) == "sync" and c.id not in numerics_tails]
    numerics = [c for c in checks if group_of(c.id) == "numerics" or c.id in numerics_tails]
    return Verdicts(sync=_group_verdict(sync, errored), numerics=_group_verdict(numerics, errored))


SEVERITY = (Verdict.ERROR, Verdict.FAIL, Verdict.INCONCLUSIVE, Verdict.PASS)
"""Worst first: the run's verdict is the first of these that either group has."""


def combined(verdicts: Verdicts) -> Verdict:
    """The run's verdict from both groups: error > fail > inconclusive > pass."""
    have = {verdicts.sync.verdict, verdicts.numerics.verdict}
    return next(v for v in SEVERITY if v in have)


def c_parity_thresholds(budgets: Budgets, a: ComparisonStats | None) -> dict[str, Threshold]:
    """C.parity budgets per statistic: relative to A's (budgets.c_relative) where A was measured, else absolute."""
    rel = budgets.c_relative
    out: dict[str, Threshold] = {}
    for short, field in STATS:
        absolute = float(getattr(budgets, short))
        if rel is None or a is None:
            out[short] = Threshold(absolute)
            continue
        observed_a = float(getattr(a, field))
        out[short] = Threshold(rel.factor * observed_a + rel.floor,
                               f"{rel.factor:g} x A's {observed_a:.4g} + {rel.floor:g}")
    return out


def a_parity_thresholds(
    budgets: Budgets, trainer_fp32: ComparisonStats | None, sampler_fp32: ComparisonStats | None
) -> dict[str, Threshold] | None:
    """A.parity budgets from the fp32 reference (budgets.a_triangulation): mean and p99 at most factor ×
    the two sides' distances from fp32 combined (with the noise rule: root sum of squares, what two
    independent errors add to; before it: the larger), max under the absolute max ceiling; None without
    a reference."""
    tri = budgets.a_triangulation
    if tri is None or trainer_fp32 is None or sampler_fp32 is None:
        return None
    out: dict[str, Threshold] = {}
    for short, field in STATS[:2]:
        t, s = float(getattr(trainer_fp32, field)), float(getattr(sampler_fp32, field))
        if budgets.noise is None:
            larger = max(t, s)
            out[short] = Threshold(tri.factor * larger,
                                   f"{tri.factor:g} x the larger side-vs-fp32 {short} {larger:.4g}")
        else:
            both = math.hypot(t, s)
            out[short] = Threshold(tri.factor * both, f"{tri.factor:g} x the root sum of squares of trainer {t:.4g} "
                                                      f"and sampler {s:.4g} vs fp32 ({short}) = {both:.4g}")
    out["max"] = Threshold(tri.max, "the fp32-triangulated max ceiling")
    return out


def farther_side(trainer_fp32: ComparisonStats, sampler_fp32: ComparisonStats, field: str) -> str:
    """Which side is farther from fp32 on a statistic, in words, for a failing A check's reason."""
    t, s = float(getattr(trainer_fp32, field)), float(getattr(sampler_fp32, field))
    side = "sampler" if s > t else "trainer"
    return f"the {side} is farther from fp32 (trainer {t:.4g}, sampler {s:.4g})"


@dataclass(frozen=True)
class DeltaThresholds:
    """Thresholds of one delta's cosine, scale error and rel_l2 checks (and, triangulated, the trainer's own)."""

    cosine: Threshold
    scale: Threshold
    rel_l2: Threshold
    undecidable: bool = False
    """kε/|t| >= 1: noise could turn the change any way, so neither pass nor fail can be claimed."""
    trainer: Threshold | None = None
    """Triangulated (`NoiseRule.delta_reference`): the trainer's own rel_l2 from the fp32 change at most the noise
    ratio + factor × the engine's (a trainer that computes its own change wrongly: dropout on, another scale)."""


def delta_thresholds(budgets: Budgets, zero_init_l2: float | None, trainer_norm: float | None,
                     relative: float = 0.0, precision: float | None = None,
                     engine: float | None = None) -> DeltaThresholds:
    """Fixed budgets, loosened to what noise of norm k·ε can explain (budgets.target_noise_k): with
    r = min(1, kε/|t| + relative), cosine >= min(min_delta_cosine, cos(asin(r))) and scale, rel_l2 <=
    max(budget, r). `relative`: the error the change itself carries (the noise rule's relative_k × ρ).
    Triangulated (|t| then ‖Δfp32‖; `precision` and `engine`: the trainer's and the engine's rel_l2 from the fp32
    change): r is at least a_triangulation.factor × the trainer's (the engine may be that many times as far off
    the true change as the trainer), and the trainer's own is judged against r + factor × the engine's."""
    k = budgets.target_noise_k
    fixed = DeltaThresholds(Threshold(budgets.min_delta_cosine), Threshold(budgets.max_delta_scale_error),
                            Threshold(budgets.max_delta_rel_l2))
    if k is None or zero_init_l2 is None or not trainer_norm:
        return fixed
    ratio = k * zero_init_l2 / trainer_norm + relative
    note = f"noise allows {k:g} x {zero_init_l2:.3g} / {trainer_norm:.3g}"
    note = f"{note} + {relative:.3g} = {ratio:.3g}" if relative else f"{note} = {ratio:.3g}"
    factor = budgets.a_triangulation.factor if budgets.a_triangulation is not None else None
    trainer = None
    if precision is not None and factor is not None:
        if engine is not None:
            trainer = Threshold(ratio + factor * engine, f"{note} + {factor:g} x the engine's own {engine:.3g} off "
                                                         f"the fp32 change")
        if factor * precision > ratio:
            ratio, note = factor * precision, (f"{factor:g} x the trainer's own {precision:.3g} off the fp32 change "
                                               f"(above what {note})")
        else:
            note = f"{note} (the trainer's own {precision:.3g} off the fp32 change x {factor:g} is less)"
    cosine = math.cos(math.asin(min(1.0, ratio)))
    undecidable = ratio >= 1.0

    def loosen(t: Threshold, value: float, looser: bool) -> Threshold:
        return Threshold(value, note, undecidable) if looser or undecidable else t

    return DeltaThresholds(
        loosen(fixed.cosine, cosine, cosine < budgets.min_delta_cosine),
        loosen(fixed.scale, ratio, ratio > budgets.max_delta_scale_error),
        loosen(fixed.rel_l2, ratio, ratio > budgets.max_delta_rel_l2),
        undecidable=undecidable,
        trainer=trainer,
    )
