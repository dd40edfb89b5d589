"""Checks of the mixed batch (`run.mixed_batch`; docs/deployment.md, "Mixed batches"): each route served in a batch
that mixes the base model and adapter versions scores as it did alone (`M.base`, `M.updated`, `M.old`), within the
sampler's repeat noise or what the same batch all under one adapter moves (`mixed_control`), whichever is larger.
Where a route fails, the findings say whose scores it got instead, from the same raw scores. Pure: `verify`
recomputes everything here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_parity.evidence.receipt import ComparisonStats
from lora_parity.verdict.check_rules import Threshold

ALONE = {"base": "base_after_sync", "updated": "updated", "old": "old_after_sync"}
"""Route -> its scores alone."""
MIXED = {"base": "mixed_base", "updated": "mixed_updated", "old": "mixed_old"}
"""Route -> its requests' scores in the mixed batch."""
CONTROL = "M.control_vs_alone"
SAMPLER_FP32 = "R.sampler_vs_fp32"
"""The sampler's distance from the fp32 reference at the start point (`NoiseRule.mixed_fp32`)."""
COMPARISONS: dict[str, tuple[str, str]] = {
    **{f"M.{route}_vs_alone": (ALONE[route], MIXED[route]) for route in ALONE},
    CONTROL: ("updated", "mixed_control"),
    # Whose scores a failing route got instead (the findings' reason).
    **{f"M.{route}_vs_{other}_alone": (ALONE[other], MIXED[route]) for route in ALONE for other in ALONE
       if other != route},
}
WHAT = {"base": "the base model's requests", "updated": "the synced adapter's requests",
        "old": "the replaced version's requests"}
OWNER = {"base": "the base model's", "updated": "the synced adapter's", "old": "the replaced version's"}


def check_ids(comparisons: Mapping[str, ComparisonStats]) -> list[str]:
    """The checks this run makes: the routes the mixed batch served."""
    return [f"M.{route}" for route in ALONE if f"M.{route}_vs_alone" in comparisons]


def threshold(comparisons: Mapping[str, ComparisonStats], repeat: Threshold, noise_factor: float,
              fp32_bound: bool = False) -> Threshold:
    """What a route may move in the mixed batch: the sampler's repeat bound (`repeat`), or noise_factor × what the
    same batch all under the synced adapter moved its scores, whichever is larger; with `fp32_bound`
    (`NoiseRule.mixed_fp32`) also twice the sampler's largest distance from the fp32 reference at the start point
    (`R.sampler_vs_fp32`, where scored)."""
    control = comparisons.get(CONTROL)
    if control is None:
        found = repeat
    elif noise_factor * control.max_abs <= repeat.budget:
        found = Threshold(repeat.budget, f"{repeat.note or repeat.budget}; the same batch under one adapter moved "
                                         f"{control.max_abs:.3g}")
    else:
        found = Threshold(noise_factor * control.max_abs,
                          f"{noise_factor:g} x what the same batch under one adapter moved ({control.max_abs:.3g})")
    fp32 = comparisons.get(SAMPLER_FP32) if fp32_bound else None
    if fp32 is None or 2 * fp32.max_abs <= found.budget:
        return found
    return Threshold(2 * fp32.max_abs, f"2 x the sampler's largest distance from fp32 at the start point "
                                      f"({fp32.max_abs:.3g}; {found.note or found.budget})")


def add_checks(c: Any, comparisons: Mapping[str, ComparisonStats], thresholds: Mapping[str, Threshold]) -> None:
    """M.base, M.updated, M.old: each route in the mixed batch gives its scores alone."""
    for check_id in check_ids(comparisons):
        route = check_id.removeprefix("M.")
        cmp, t = comparisons[f"M.{route}_vs_alone"], thresholds[check_id]
        c.add(check_id, f"{WHAT[route]} in a batch mixing routes score as alone", cmp.max_abs, "<=", t.budget,
              _reason(route, comparisons, t.budget), note=t.note, n=cmp.n)


def _reason(route: str, comparisons: Mapping[str, ComparisonStats], budget: float) -> str:
    """Whose scores `route`'s requests got in the mixed batch, where another route's alone scores explain them."""
    got = [OWNER[other] for other in ALONE if (cross := comparisons.get(f"M.{route}_vs_{other}_alone")) is not None
           and cross.max_abs <= budget]
    if got:  # the zero-init version scores as the base model: both are named where both explain the scores
        return (f"in a batch mixing routes, {WHAT[route]} got {' or '.join(got)} scores: the engine maps LoRA slots "
                "to the wrong requests (vllm #16040, #36370)")
    return f"in a batch mixing routes, {WHAT[route]} score otherwise than alone (a mixed batch's LoRA mapping)"
