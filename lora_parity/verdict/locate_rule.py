"""The first divergence of the base forward (`lora-parity locate`, docs/locate.md): pure statistics and the rule.

Each side's hidden state at each point of the forward is compared with the fp32 reference's, token by token (relative
L2). What a side's precision explains at a point is measured in the same run, at that point: by the other side (the
same precision, other kernels) and, for an fp32 checkpoint, by the fp32 reference's own distance from an fp64
forward. A side leaves where its distance exceeds `LocateRule.balance` × that witness's, beyond `LocateRule.k`
standard errors on both; the first such point (in forward order) names the layer and the module.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lora_parity.evidence.locate_models import (
    Distance,
    Divergence,
    LocateRule,
    PickedSequence,
    Point,
    SideAtPoint,
    Spread,
)
from lora_parity.verdict.stats import quantile

PerSequence = Sequence[Sequence[float]]
"""Per-token values, one list per sequence."""
A_PARITY = ("A.parity.", "A.fp32.")
"""A's checks that compare the two sides' (or each side's and fp32's) base-model scores: what locate explains."""
NUM_BLOCKS = 4
"""One sequence alone: its tokens are split into this many contiguous blocks for the jackknife."""


def pick_sequences(scores: Mapping[str, PerSequence], count: int) -> list[PickedSequence]:
    """The `count` sequences with the largest A differences (|zero − trainer_zero| per token; by the max, then the
    mean), worst first. `ValueError` where the receipt has no A scores."""
    if "zero" not in scores or "trainer_zero" not in scores:
        raise ValueError("the receipt has no zero-init scores of both sides (phases zero and trainer_zero)")
    picked = []
    for i, (engine, trainer) in enumerate(zip(scores["zero"], scores["trainer_zero"], strict=True)):
        diffs = [abs(a - b) for a, b in zip(engine, trainer, strict=True)]
        if diffs:
            picked.append(PickedSequence(index=i, num_tokens=len(diffs) + 1, max_abs=max(diffs),
                                         mean_abs=math.fsum(diffs) / len(diffs)))
    picked.sort(key=lambda p: (-p.max_abs, -p.mean_abs, p.index))
    return picked[:count]


def _groups(per_sequence: PerSequence) -> list[list[float]]:
    """The jackknife's groups: the sequences, or a lone sequence's contiguous blocks of tokens."""
    seqs = [list(s) for s in per_sequence if len(s)]
    if len(seqs) != 1:
        return seqs
    only = seqs[0]
    size = math.ceil(len(only) / NUM_BLOCKS)
    return [only[i:i + size] for i in range(0, len(only), size)]


def jackknife(per_sequence: PerSequence, stat: Callable[[list[float]], float]) -> Spread:
    """`stat` over every value, and its delete-one-group jackknife standard error (`_groups`; 0 for one group)."""
    groups = _groups(per_sequence)
    pooled = [x for g in groups for x in g]
    if not pooled:
        raise ValueError("no tokens to compare")
    value = stat(pooled)
    n = len(groups)
    if n < 2:
        return Spread(value=value, se=0.0)
    leave_out = [stat([x for j, g in enumerate(groups) if j != i for x in g]) for i in range(n)]
    mean = math.fsum(leave_out) / n
    return Spread(value=value, se=math.sqrt((n - 1) / n * math.fsum((v - mean) ** 2 for v in leave_out)))


def distance(per_sequence: PerSequence) -> Distance:
    """The median and the max over tokens of per-token distances, with their jackknife standard errors."""
    return Distance(median=jackknife(per_sequence, statistics.median), max=jackknife(per_sequence, max))


@dataclass(frozen=True)
class PointData:
    """What was measured at one point: per-token distances from fp32, per sequence."""

    name: str
    layer: int | None
    module: str
    trainer: PerSequence
    engine: PerSequence
    fp32_vs_fp64: PerSequence | None = None
    """The fp32 reference against an fp64 forward (fp32 checkpoints), else None."""


def rounding_floor(dtype_eps: float, hidden_size: int) -> float:
    """What one reduction over the hidden dimension explains in a dtype of machine epsilon `dtype_eps`: √H × u
    (u = eps / 2, the unit roundoff; the typical relative error of a length-H sum, Higham). The witness only where
    nothing was measured (`_witness`): both sides and the fp64 forward equal to the fp32 reference there."""
    return math.sqrt(hidden_size) * dtype_eps / 2


def tail_bound(per_sequence: PerSequence, num_tokens: int, alpha: float) -> float:
    """The largest of `num_tokens` values that the measured ones' tail predicts (the project's noise model, docs/
    verdicts.md): p90 + β ln(0.1 n / α), β = (p99 − p90) / ln 10 the exponential tail's scale above p90."""
    ranked = sorted(x for s in per_sequence for x in s)
    p90, p99 = quantile(ranked, 0.90), quantile(ranked, 0.99)
    return p90 + (p99 - p90) / math.log(10) * math.log(max(0.1 * num_tokens / alpha, 1.0))


@dataclass(frozen=True)
class _Witness:
    name: str
    distance: Distance | None
    tail: float
    """`tail_bound` of its tokens for as many tokens as the side judged."""


def _witness(other: PerSequence, fp64: PerSequence | None, floor: float, num_tokens: int,
             alpha: float) -> _Witness:
    """The larger measure of what the precision explains at a point (by the median); the dtype's rounding
    (`rounding_floor`) where every measure is 0 (nothing computed differently there), or none without a floor."""
    candidates = [("other side", other)] + ([("fp32 vs fp64", fp64)] if fp64 is not None else [])
    measured = [(name, distance(values), values) for name, values in candidates]
    name, best, values = max(measured, key=lambda c: (c[1].median.value, c[1].max.value))
    if best.median.value == 0 and best.max.value == 0:
        if floor <= 0:
            return _Witness("none", None, 0.0)
        at = Spread(value=floor, se=0.0)
        return _Witness("dtype rounding", Distance(median=at, max=at), floor)
    return _Witness(name, best, tail_bound(values, num_tokens, alpha))


def judge_side(own: PerSequence, other: PerSequence, fp64: PerSequence | None, rule: LocateRule,
               floor: float = 0.0) -> SideAtPoint:
    """One side at one point, against the witness (`_witness`): the median leaves beyond balance × (the witness's
    median + k se) + k × its own se; the max beyond balance × the largest of as many tokens the witness's tail
    predicts (`tail_bound`: a max has no useful jackknife se, one far token inflates its own)."""
    mine = distance(own)
    num_tokens = sum(len(s) for s in own)
    w = _witness(other, fp64, floor, num_tokens, rule.tail_alpha)
    median_t = rule.k * mine.median.se
    if w.distance is not None:
        median_t += rule.balance * (w.distance.median.value + rule.k * w.distance.median.se)
    max_t = rule.balance * w.tail
    return SideAtPoint(distance=mine, witness=w.name, median_threshold=median_t,  # type: ignore[arg-type]
                       max_threshold=max_t, leaves=mine.median.value > median_t or mine.max.value > max_t)


def judge(points: Sequence[PointData], rule: LocateRule, floor: float = 0.0,
          near_ties: Mapping[tuple[int, int], int] | None = None) -> tuple[list[Point], list[Divergence]]:
    """Every point judged for both sides (`floor`: `rounding_floor` of the sides' dtype), and the first point each
    side leaves at (trainer first). `near_ties` (MoE: `locate_routes.near_ties`) are tokens some side routed apart
    from fp32 at a near tie, by sequence and position, with the MoE layer where it did: from that layer's output
    on they are left out on both sides (`Point.left_out`), their distance being precision's."""
    judged: list[Point] = []
    for p in points:
        out = _left_out(p, near_ties or {})
        trainer, engine = _without(p.trainer, out), _without(p.engine, out)
        fp64_data = _without(p.fp32_vs_fp64, out) if p.fp32_vs_fp64 is not None else None
        fp64 = distance(fp64_data) if fp64_data is not None else None
        judged.append(Point(name=p.name, layer=p.layer, module=p.module, fp32_vs_fp64=fp64, left_out=len(out),
                            trainer=judge_side(trainer, engine, fp64_data, rule, floor),
                            engine=judge_side(engine, trainer, fp64_data, rule, floor)))
    return judged, first_divergences(judged)


def _left_out(p: PointData, near_ties: Mapping[tuple[int, int], int]) -> set[tuple[int, int]]:
    """The near-tie tokens whose MoE layer computes at or before `p`: its output (`layers.L`), later layers, the
    final norm."""
    def after(layer: int) -> bool:
        return p.name == "norm" or (p.layer is not None and (p.layer > layer or p.name == f"layers.{layer}"))

    return {token for token, layer in near_ties.items() if after(layer)}


def _without(values: PerSequence, out: set[tuple[int, int]]) -> PerSequence:
    if not out:
        return values
    return [[x for t, x in enumerate(seq) if (s, t) not in out] for s, seq in enumerate(values)]


def first_divergences(points: Sequence[Point]) -> list[Divergence]:
    """Per side, the first point (forward order) where it leaves; the median named where both statistics left."""
    found = []
    for side in ("trainer", "engine"):
        for p in points:
            at: SideAtPoint = getattr(p, side)
            if not at.leaves:
                continue
            by_median = at.distance.median.value > at.median_threshold
            observed = at.distance.median.value if by_median else at.distance.max.value
            found.append(Divergence(side=side, point=p.name, layer=p.layer, module=p.module,
                                    statistic="median" if by_median else "max", observed=observed,
                                    threshold=at.median_threshold if by_median else at.max_threshold))
            break
    return found


def failing_a(checks: Sequence[object]) -> list[str]:
    """A's failing checks on the base forward (`A_PARITY`), by id."""
    return [str(getattr(c, "id", "")) for c in checks
            if str(getattr(c, "id", "")).startswith(A_PARITY) and str(getattr(c, "status", "")) == "fail"]


def locate_hint(checks: Sequence[object], path: str) -> str | None:
    """The line a run prints where A failed on the base forward: the command that names where the sides part."""
    failed = failing_a(checks)
    if not failed:
        return None
    return (f"next: lora-parity locate {path}  (A failed before any update ({', '.join(failed[:3])}): the first layer "
            "and module where a side's hidden states leave what its precision explains, against the fp32 reference)")


def summary_line(divergences: Sequence[Divergence], points: Sequence[Point] = ()) -> str:
    """One line for people: where each side parts, or that neither does; and the near-tie tokens left out."""
    first = next((p for p in points if p.left_out), None)
    aside = (f" ({max(p.left_out for p in points)} token(s) that a side routed apart from fp32 at a near tie left "
             f"out from {first.name} on: precision)") if first is not None else ""
    if not divergences:
        return "no layer named: both sides stay within what their precision explains at every point" + aside
    parts = []
    for d in divergences:
        where = f"layer {d.layer}, {d.module}" if d.layer is not None else d.module
        parts.append(f"the {d.side} leaves at {d.point} ({where}): {d.statistic} distance from fp32 {d.observed:.3g} "
                     f"> {d.threshold:.3g}")
        if d.statistic == "max":
            parts[-1] += " (a few tokens)"
    return "; ".join(parts) + aside
