"""The exact reference (E; docs/verdicts.md, "The exact reference"): where the sampler's arithmetic can be mirrored
bit for bit (vLLM's own operations, `backends.exact`), the trainer's tensors in memory are scored that way at the
start point (`exact.zero`), the updated point (`exact.updated`) and every per-target and per-layer point
(`exact.target.K`). Where the mirror reproduces the engine at the start point exactly and the engine repeats itself
exactly, the engine must equal it at every later point too: any difference, of any size, is a fault in what the
engine reads or computes, and no noise can explain it. Where the mirror does not reproduce the start point, it is
not used (no E check: none passes on nothing). Pure: scores in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lora_parity.evidence.receipt import Budgets, ComparisonStats
from lora_parity.verdict import stats

PREFIX = "exact."
GATE = "E.zero"
"""The start point's comparison: the mirror must reproduce the engine there exactly, or E is not used."""
NOTE = "bitwise: the exact reference scored the start point exactly as the engine, which repeats itself exactly"
SAME = 1e-3
"""Slopes within this of each other are one scale (`lines`): the mirror has no noise, only rounding."""


def pairs(scores: Mapping[str, object]) -> dict[str, tuple[str, str]]:
    """Comparison name -> (exact reference key, sampler key), for the points whose two scores exist."""
    out = {GATE: (f"{PREFIX}zero", "zero"), "E.updated": (f"{PREFIX}updated", "updated")}
    for key in scores:
        if key.startswith(f"{PREFIX}target."):
            tag = key[len(f"{PREFIX}target."):]
            out[f"E.target.{tag}"] = (key, f"target.{tag}.sampler")
    return {name: (a, b) for name, (a, b) in out.items() if a in scores and b in scores}


def comparisons(scores: Mapping[str, Sequence[Sequence[float]]], budgets: Budgets) -> dict[str, ComparisonStats]:
    """The exact reference against the engine at every point both scored."""
    return {name: ComparisonStats(a=a, b=b, **stats.summarize(scores[a], scores[b], over=budgets.mean))  # type: ignore[arg-type]
            for name, (a, b) in pairs(scores).items()}


def mirrors(comparisons: Mapping[str, ComparisonStats]) -> bool:
    """The mirror reproduced the engine at the start point exactly, and the engine repeated the synced adapter
    exactly (where it scored it twice)."""
    gate, repeat = comparisons.get(GATE), comparisons.get("C.sampler_repeat")
    return gate is not None and gate.max_abs == 0 and (repeat is None or repeat.max_abs == 0)


def check_ids(comparisons: Mapping[str, ComparisonStats]) -> list[str]:
    """The E checks this run makes: one per later point, where the mirror holds (`mirrors`)."""
    if not mirrors(comparisons):
        return []
    return [f"{name}.identical" for name in comparisons if name.startswith("E.") and name != GATE]


def add_checks(c: Any, comparisons: Mapping[str, ComparisonStats]) -> None:
    """E.updated.identical and E.target.K.identical: the engine equals the exact reference bit for bit."""
    for check_id in check_ids(comparisons):
        name = check_id.removesuffix(".identical")
        point = "the updated point" if name == "E.updated" else f"target {name.removeprefix('E.target.')}"
        c.add(check_id, f"engine = exact reference at {point}, bit for bit", comparisons[name].max_abs, "<=", 0.0,
              "the engine does not compute what its own operations compute with the trainer's tensors", note=NOTE,
              n=comparisons[name].n)


def _slope(scores: Mapping[str, Sequence[Sequence[float]]], point: str) -> float | None:
    """The engine's change from the start point over the exact reference's, through the origin."""
    a, b = pairs(scores)[point]
    ds = stats.differences(scores["zero"], scores[b])
    de = stats.differences(scores[f"{PREFIX}zero"], scores[a])
    den = math.fsum(x * x for x in de)
    return math.fsum(x * y for x, y in zip(ds, de, strict=True)) / den if den > 0 else None


def _correlation(x: Sequence[float], y: Sequence[float]) -> float:
    den = math.sqrt(math.fsum(a * a for a in x) * math.fsum(b * b for b in y))
    return math.fsum(a * b for a, b in zip(x, y, strict=True)) / den if den > 0 else 0.0


def lines(scores: Mapping[str, Sequence[Sequence[float]]], failed: set[str]) -> list[str]:
    """The findings of failed E checks (among the ids `failed`): one scale in every module, a swap of two
    targets, or the points that part."""
    points = [p for p in pairs(scores) if p != GATE]
    failing = [p for p in points if f"{p}.identical" in failed]
    if not failing:
        return []
    slopes = {p: _slope(scores, p) for p in points}
    found = [s for s in slopes.values() if s is not None]
    head = "exact reference: the engine does not compute what its own operations compute with the trainer's tensors"
    if len(failing) == len(points) and found and max(found) - min(found) <= SAME:
        where = _count(points)
        return [f"{head}: a scale: it applies every update at {sum(found) / len(found):.4f} of the trainer's, in "
                f"every module ({where} agree; no noise: the reference is exact); the tensors the engine holds are "
                "not the trainer's (a lora_alpha or rsLoRA scale, a cast, a loader's scaling)"]
    swap = _swap(scores, failing)
    if swap is not None:
        return [f"{head}: a swap: the engine's change under {swap[0]} is the reference's under {swap[1]} and "
                "the other way round"]
    order = [p for p in failing if p != "E.updated"] + [p for p in failing if p == "E.updated"]
    shown = [_named(p) + (f" (at {slopes[p]:.3g} of the trainer's change)" if slopes.get(p) is not None else "")
             for p in order]
    return [f"{head}: {', '.join(shown[:6])}{' and more' if len(shown) > 6 else ''} part from it ({len(failing)} "
            f"of {len(points)} points; the rest equal it bit for bit)"]


def _named(point: str) -> str:
    if point == "E.updated":
        return "the whole update"
    kind, _, layers = point.removeprefix("E.target.").partition("@")
    return f"{kind} in layers {layers}" if layers else kind


def _count(points: Sequence[str]) -> str:
    targets = [p for p in points if p.startswith("E.target.")]
    layered = sum("@" in p for p in targets)
    return f"the update and {len(targets) - layered} targets" + (f" and {layered} layer groups" if layered else "")


def _swap(scores: Mapping[str, Sequence[Sequence[float]]], failing: Sequence[str]) -> tuple[str, str] | None:
    """Two per-target points failing alone whose engine changes are each the other's reference change."""
    kinds = [p for p in failing if p.startswith("E.target.") and "@" not in p]
    if len(kinds) != 2:
        return None
    changes = {}
    for p in kinds:
        a, b = pairs(scores)[p]
        start = scores[f"{PREFIX}zero"]
        changes[p] = (stats.differences(scores["zero"], scores[b]), stats.differences(start, scores[a]))
    (p, (sp, ep)), (q, (sq, eq)) = changes.items()
    if min(_correlation(sp, eq), _correlation(sq, ep)) > 0.99 > max(_correlation(sp, ep), _correlation(sq, eq)):
        return p.removeprefix("E.target."), q.removeprefix("E.target.")
    return None
