"""The checks of a change: C.delta's and each target's direction, scale and rel_l2 (and, triangulated, the
trainer's own), and the slopes (C.slope, T.K.slope). `c` is `checks`' checker, passed in (no import back)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lora_parity.evidence.receipt import CheckStatus, DeltaStats
from lora_parity.verdict import check_rules, stats
from lora_parity.verdict.thresholds import DIRECT


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
    thresholds are loosened to what the start point's noise explains (`thresholds.delta`). Triangulated, against
    Δfp32, and where the rule has it (`NoiseRule.delta_direct`) against Δtrainer too: a check the direct
    comparison decides and passes passes (`_decided_directly`)."""
    reached = delta is not None
    cosine, scale, rel = (th[f"{prefix}.{k}"] for k in ("cosine", "scale", "rel_l2"))
    undecidable = "noise as large as the change explains any direction and scale" if cosine.undecidable else None
    # triangulated (NoiseRule.delta_reference): against the fp32 reference's change, the side named on failure
    to, side = ("Δfp32", side_of(delta)) if delta is not None and delta.reference_to is not None else ("Δtrainer", "")
    scale_err = abs(delta.scale - 1) if delta and delta.scale is not None else None
    rows = [("cosine", "Δsampler points the same way as {to}", delta.cosine if delta else None, ">=", cosine,
             why or f"sampler moved in another direction{side}"),
            ("scale", "|‖Δsampler‖/‖{to}‖ - 1| within budget", scale_err, "<=", scale,
             why or f"sampler moved by another amount{side}")]
    if rel_l2:
        rows.append(("rel_l2", "‖Δsampler - {to}‖/‖{to}‖ within budget", delta.rel_l2 if delta else None, "<=", rel,
                     f"sampler's change differs from the fp32 reference's{side}" if side
                     else "sampler's change differs from trainer's"))
    for stat, name, observed, op, t, reason in rows:
        direct = _decided_directly(delta, stat, op, th.get(f"{prefix}.{stat}{DIRECT}"))
        if direct is not None and not (undecidable is None and observed is not None and _holds(observed, op, t.budget)):
            value, budget, note = direct
            c.add(f"{prefix}.{stat}", name.format(to="Δtrainer"), value, op, budget, reason, reached=reached,
                  failing=failing, note=note, n=n)
            continue
        c.add(f"{prefix}.{stat}", name.format(to=to), observed, op, t.budget, reason, reached=reached,
              failing=failing, note=t.note, undecidable=undecidable, n=n)
    own = th.get(f"{prefix}.trainer")
    if side and own is not None and delta is not None:  # the trainer's own change against the true one (numerics)
        c.add(f"{prefix}.trainer", "‖Δtrainer - Δfp32‖/‖Δfp32‖ within the noise + factor x the engine's",
              delta.trainer_rel_l2, "<=", own.budget, f"the trainer's own change is off the fp32 reference's{side}",
              note=own.note, n=n)


def _holds(observed: float, op: str, budget: float) -> bool:
    return observed >= budget if op == ">=" else observed <= budget


def _decided_directly(delta: DeltaStats | None, stat: str, op: str, t: check_rules.Threshold | None
                      ) -> tuple[float, float, str] | None:
    """(observed, budget, note) of Δsampler against Δtrainer on `stat` where that comparison decides and passes
    (`NoiseRule.delta_direct`): the engine computed the trainer's change within the start point's noise, however far
    both are from the fp32 reference's (bf16 precision as large as the change leaves that comparison undecided)."""
    if delta is None or t is None or t.undecidable:
        return None
    observed = {"cosine": delta.direct_cosine, "rel_l2": delta.direct_rel_l2,
                "scale": None if delta.direct_scale is None else abs(delta.direct_scale - 1)}[stat]
    if observed is None or not _holds(observed, op, t.budget):
        return None
    ref = f"; the trainer's change is {delta.trainer_rel_l2:.3g} off the fp32 reference's, both sides alike" \
        if delta.trainer_rel_l2 is not None else ""
    return observed, t.budget, f"against Δtrainer: {t.note or 'the budget'}{ref}"


def side_of(delta: DeltaStats) -> str:
    """Which side is off the fp32 reference's change, in words, for a triangulated delta check's failure."""
    if delta.rel_l2 is None or delta.trainer_rel_l2 is None:
        return ""
    return (f" (the engine's change is {delta.rel_l2:.3g} off the fp32 reference's, the trainer's "
            f"{delta.trainer_rel_l2:.3g}: the {'engine' if delta.rel_l2 > delta.trainer_rel_l2 else 'trainer'} is off)")
