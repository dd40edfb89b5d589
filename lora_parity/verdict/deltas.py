"""The deltas: C's change (zero-init to updated) and each per-target run's, on both sides, and C.slope's
evidence, the sampler's share of the trainer's change (`update_slopes`). Pure: scores in, numbers out."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lora_parity.verdict import stats

# name -> (sampler_from, sampler_to, trainer_from, trainer_to)
DELTAS: dict[str, tuple[str, str, str, str]] = {
    "C.delta": ("zero", "updated", "trainer_zero", "trainer_updated"),
}
TARGET_PREFIX = "target."
REFERENCE_AT = {"C.delta": "reference_fp32_updated"}
"""Delta name -> the fp32 reference scored with the trainer's tensors at its end point (a target's:
`target.K.reference`); its change from `reference_fp32` is what both sides approximate."""


def reference_at(name: str) -> str:
    """The fp32 reference phase at the end point of delta `name` (C.delta or `target.K`)."""
    return REFERENCE_AT.get(name, f"{name}.reference")


def delta_specs(scores: Mapping[str, object]) -> dict[str, tuple[str, str, str, str]]:
    """C.delta and every per-target delta whose four phases were scored."""
    specs = dict(DELTAS)
    for kind in target_kinds(scores):
        specs[f"{TARGET_PREFIX}{kind}"] = target_delta_spec(kind)
    return {name: spec for name, spec in specs.items() if all(p in scores for p in spec)}


Slopes = tuple["stats.Slope | None", dict[str, "stats.Slope | None"], bool]


def update_slopes(scores: Mapping[str, Sequence[Sequence[float]]]) -> Slopes:
    """C.slope's evidence: the sampler's share of the trainer's change pooled over C and every per-target
    run, and each run's own; whether the fp32 reference's change was the regressor (where it was scored at
    every end point and at the start), else the trainer's change."""
    specs = delta_specs(scores)
    if not specs:
        return None, {}, False
    with_reference = "reference_fp32" in scores and all(reference_at(n) in scores for n in specs)
    first = next(iter(specs.values()))
    ids, blocks = stats.block_ids([len(s) for s in scores[first[0]]])
    phases = {}
    for name, (sf, st, tf, tt) in specs.items():
        dt = stats.differences(scores[tf], scores[tt])
        dr = stats.differences(scores["reference_fp32"], scores[reference_at(name)]) if with_reference else dt
        phases[name] = (stats.differences(scores[sf], scores[st]), dt, dr)
    each = {name: stats.update_slope([p], ids, blocks) for name, p in phases.items()}
    return stats.update_slope(list(phases.values()), ids, blocks), each, with_reference


def reference_shares(scores: Mapping[str, Sequence[Sequence[float]]]) -> tuple[float, float] | None:
    """Each side's share of the fp32 reference's change, pooled over the runs C.slope pools: Σ Δside·Δfp32 /
    Σ Δfp32·Δfp32, the trainer's and the engine's (1: that side makes the change fp32 makes). None without the fp32
    reference at the start and every end point, or where fp32 does not move."""
    specs = delta_specs(scores)
    if not specs or "reference_fp32" not in scores or not all(reference_at(n) in scores for n in specs):
        return None
    trainer, engine, norm = [], [], []
    for name, (sf, st, tf, tt) in specs.items():
        dr = stats.differences(scores["reference_fp32"], scores[reference_at(name)])
        ds, dt = stats.differences(scores[sf], scores[st]), stats.differences(scores[tf], scores[tt])
        trainer += [t * r for t, r in zip(dt, dr, strict=True)]
        engine += [s * r for s, r in zip(ds, dr, strict=True)]
        norm += [r * r for r in dr]
    total = math.fsum(norm)
    return (math.fsum(trainer) / total, math.fsum(engine) / total) if total > 0 else None


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
