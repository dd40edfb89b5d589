"""The checks of a change: C.delta's and each target's direction, scale and rel_l2 (and, triangulated, the
trainer's own), and the slopes (C.slope, T.K.slope). `c` is `checks`' checker, passed in (no import back)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_parity.evidence.receipt import CheckStatus, DeltaStats
from lora_parity.verdict import check_rules, stats


def slope_check(c: Any, slope: stats.Slope | None, t: check_rules.Threshold, reached: bool,
                 failing: CheckStatus, id: str = "C.slope", what: str = "pooled", n: int | None = None) -> None:
    """C.slope (or a target's T.K.slope): the sampler makes the trainer's whole change, pooled over C and every
    per-target run (or in that run): |ratio − 1| within k standard errors + the floor (`thresholds.slope`).
    Where no uncertainty could be estimated it is inconclusive, never a pass."""
    name = f"the sampler makes the trainer's whole change ({what})"
    if slope is None:
        c.add(id, name, None, "<=", t.budget, "no slope: no change, or too few positions to estimate its "
              "uncertainty", reached=reached, failing=CheckStatus.INCONCLUSIVE, note=t.note, n=n)
        return
    ratio, se, _ = slope
    c.add(id, name, abs(ratio - 1), "<=", t.budget, f"the sampler makes {ratio:.4g} ± {se:.2g} of the trainer's "
          "change", reached=reached, failing=failing, note=t.note, n=n)


def delta_checks(
    c: Any, prefix: str, delta: DeltaStats | None, th: Mapping[str, check_rules.Threshold],
    failing: CheckStatus, rel_l2: bool = True, why: str | None = None, n: int | None = None,
) -> None:
    """Direction, scale (and rel_l2) of Δsampler vs Δtrainer; `why` replaces the failure reason. The
    thresholds are loosened to what the start point's noise explains (`thresholds.delta`)."""
    reached = delta is not None
    cosine, scale, rel = (th[f"{prefix}.{k}"] for k in ("cosine", "scale", "rel_l2"))
    undecidable = "noise as large as the change explains any direction and scale" if cosine.undecidable else None
    # triangulated (NoiseRule.delta_reference): against the fp32 reference's change, the side named on failure
    to, side = ("Δfp32", side_of(delta)) if delta is not None and delta.reference_to is not None else ("Δtrainer", "")
    c.add(f"{prefix}.cosine", f"Δsampler points the same way as {to}", delta.cosine if delta else None, ">=",
          cosine.budget, why or f"sampler moved in another direction{side}", reached=reached, failing=failing,
          note=cosine.note, undecidable=undecidable, n=n)
    scale_err = abs(delta.scale - 1) if delta and delta.scale is not None else None
    c.add(f"{prefix}.scale", f"|‖Δsampler‖/‖{to}‖ - 1| within budget", scale_err, "<=",
          scale.budget, why or f"sampler moved by another amount{side}", reached=reached, failing=failing,
          note=scale.note, undecidable=undecidable, n=n)
    if rel_l2:
        c.add(f"{prefix}.rel_l2", f"‖Δsampler - {to}‖/‖{to}‖ within budget", delta.rel_l2 if delta else None,
              "<=", rel.budget, (f"sampler's change differs from the fp32 reference's{side}" if side
               else "sampler's change differs from trainer's"),
              reached=reached, failing=failing, note=rel.note, undecidable=undecidable, n=n)
    own = th.get(f"{prefix}.trainer")
    if side and own is not None and delta is not None:  # the trainer's own change against the true one (numerics)
        c.add(f"{prefix}.trainer", "‖Δtrainer - Δfp32‖/‖Δfp32‖ within the noise + factor x the engine's",
              delta.trainer_rel_l2, "<=", own.budget, f"the trainer's own change is off the fp32 reference's{side}",
              note=own.note, n=n)


def side_of(delta: DeltaStats) -> str:
    """Which side is off the fp32 reference's change, in words, for a triangulated delta check's failure."""
    if delta.rel_l2 is None or delta.trainer_rel_l2 is None:
        return ""
    return (f" (the engine's change is {delta.rel_l2:.3g} off the fp32 reference's, the trainer's "
            f"{delta.trainer_rel_l2:.3g}: the {'engine' if delta.rel_l2 > delta.trainer_rel_l2 else 'trainer'} is off)")
