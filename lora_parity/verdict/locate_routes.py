"""Routing at the first divergence (`lora-parity locate` on an MoE model, docs/locate.md): pure.

Per MoE layer, each token's router scores on the fp32 reference, the trainer and the engine (the scores the family's
router ranks: softmax of the logits, or sigmoid plus the correction bias). A token *flips* where the three top-k
expert sets are not all one. Its *margin* is the reference's k-th ranked score minus its (k+1)-th: a flip whose
margin lies within what precision moves the scores (`MoeLayer.tie_band`) is a near tie that either side may break;
a flip across a wide gap means a side's scores moved further than precision does, before the router.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from lora_parity.evidence.locate_models import MoeLayer, MoeRouting, RouterFlip
from lora_parity.verdict.stats import quantile

Scores = Sequence[Sequence[Sequence[float]]]
"""[sequence][token][expert] -> the score the router ranks."""
MAX_FLIPS = 12
"""Flips listed at the chosen layer (`MoeRouting.flips`); all are counted."""
TAIL = 0.99
"""The quantile of per-token score deviations that sets the tie band."""


@dataclass(frozen=True)
class LayerScores:
    """One MoE layer's router scores on every forward, the picked sequences in order."""

    layer: int
    top_k: int
    reference: Scores
    trainer: Scores
    engine: Scores
    fp64: Scores | None = None


def top_set(scores: Sequence[float], top_k: int) -> list[int]:
    """The `top_k` experts of the highest scores, ascending (a tie goes to the lower index)."""
    ranked = sorted(range(len(scores)), key=lambda e: (-scores[e], e))
    return sorted(ranked[:top_k])


def margin(scores: Sequence[float], top_k: int) -> float:
    """The k-th highest score minus the (k+1)-th (`ValueError` unless 0 < top_k < len(scores))."""
    if not 0 < top_k < len(scores):
        raise ValueError(f"top_k must be in 1..{len(scores) - 1}, got {top_k}")
    ranked = sorted(scores, reverse=True)
    return float(ranked[top_k - 1] - ranked[top_k])


def deviation(scores: Sequence[float], reference: Sequence[float]) -> float:
    """The largest |score − reference score| over the experts."""
    return max(abs(a - b) for a, b in zip(scores, reference, strict=True))


def _tail(values: list[float]) -> float:
    return quantile(sorted(values), TAIL)


def _deviations(side: Scores, reference: Scores) -> list[float]:
    return [deviation(a, b) for sa, sr in zip(side, reference, strict=True) for a, b in zip(sa, sr, strict=True)]


def judge_layer(data: LayerScores, sequences: Sequence[int], a_diffs: Sequence[Sequence[float]],
                balance: float) -> tuple[MoeLayer, list[RouterFlip]]:
    """One MoE layer: the flips and margins, and every flipped token (`RouterFlip`). `sequences[s]` is the probe
    index of the s-th sequence, `a_diffs[s]` A's |Δlogprob| per score entry of it."""
    trainer_dev, engine_dev = _deviations(data.trainer, data.reference), _deviations(data.engine, data.reference)
    tails = {"trainer": _tail(trainer_dev), "engine": _tail(engine_dev)}
    nearer = min(tails, key=lambda side: (tails[side], side))
    witness, band = nearer, tails[nearer]
    fp64 = _tail(_deviations(data.fp64, data.reference)) if data.fp64 is not None else None
    if fp64 is not None and fp64 > band:
        witness, band = "fp32 vs fp64", fp64
    tie_band = balance * band
    margins: list[float] = []
    flips: list[RouterFlip] = []
    apart = trainer_flips = engine_flips = 0
    for s, (ref_s, tr_s, en_s) in enumerate(zip(data.reference, data.trainer, data.engine, strict=True)):
        for t, (ref, tr, en) in enumerate(zip(ref_s, tr_s, en_s, strict=True)):
            gap = margin(ref, data.top_k)
            margins.append(gap)
            sets = [top_set(x, data.top_k) for x in (ref, tr, en)]
            apart += sets[1] != sets[2]
            trainer_flips += sets[1] != sets[0]
            engine_flips += sets[2] != sets[0]
            if sets[0] == sets[1] == sets[2]:
                continue
            entry = a_diffs[s][t] if t < len(a_diffs[s]) else None
            flips.append(RouterFlip(sequence=sequences[s], position=t, reference=sets[0], trainer=sets[1],
                                    engine=sets[2], margin=gap, trainer_deviation=deviation(tr, ref),
                                    engine_deviation=deviation(en, ref), near_tie=gap <= tie_band, a_diff=entry))
    layer = MoeLayer(layer=data.layer, top_k=data.top_k, num_tokens=len(margins), apart=apart,
                     trainer_flips=trainer_flips, engine_flips=engine_flips,
                     margin_min=min(margins) if margins else 0.0,
                     margin_median=statistics.median(margins) if margins else 0.0,
                     trainer_deviation=tails["trainer"], engine_deviation=tails["engine"], fp64_deviation=fp64,
                     tie_band=tie_band, witness=witness)  # type: ignore[arg-type]
    return layer, flips


def near_ties(layers: Sequence[LayerScores], balance: float) -> dict[tuple[int, int], int]:
    """Every token (its sequence's place in `layers`' scores, its position) that a side routes apart from the fp32
    reference at a near tie (`judge_layer`'s tie band), with the first MoE layer where one does: from that layer's
    output on, its hidden states carry another expert choice, which precision explains."""
    out: dict[tuple[int, int], int] = {}
    for data in layers:
        none: list[list[float]] = [[] for _ in data.reference]
        for flip in judge_layer(data, range(len(data.reference)), none, balance)[1]:
            if flip.near_tie:
                out.setdefault((flip.sequence, flip.position), data.layer)
    return out


def _worst_first(flips: list[RouterFlip]) -> list[RouterFlip]:
    """By A's difference at the flipped token (largest first; none last), then the narrowest margin."""
    return sorted(flips, key=lambda f: (f.a_diff is None, -(f.a_diff or 0.0), f.margin, f.sequence, f.position))


def routing(layers: Sequence[LayerScores], sequences: Sequence[int], a_diffs: Sequence[Sequence[float]],
            named_layer: int | None, ranking: str, balance: float) -> MoeRouting:
    """Every MoE layer judged (`judge_layer`), and the flips listed at one: the first MoE layer at or after
    `named_layer` (the earliest layer locate names; a departure there reaches every later router), else the first
    MoE layer with a flip."""
    judged = [judge_layer(data, sequences, a_diffs, balance) for data in layers]
    chosen: tuple[MoeLayer, list[RouterFlip]] | None = None
    because = "no MoE layer routes a token otherwise on any side"
    if named_layer is not None:
        chosen = next((j for j in judged if j[0].layer >= named_layer), None)
        if chosen is not None:
            because = (f"locate names layer {named_layer}" if chosen[0].layer == named_layer else
                       f"the first MoE layer after layer {named_layer}, which locate names")
    if chosen is None:
        chosen = next((j for j in judged if j[1]), None)
        if chosen is not None:
            because = ("the first MoE layer with a flip" + (f" (no MoE layer at or after layer {named_layer}, which "
                                                            "locate names)" if named_layer is not None else
                                                            " (locate names no layer)"))
    flips = _worst_first(chosen[1]) if chosen is not None else []
    return MoeRouting(ranking=ranking, layers=[j[0] for j in judged],
                      listed_layer=chosen[0].layer if chosen is not None else None, listed_because=because,
                      flips=flips[:MAX_FLIPS], num_flips=len(flips))


def layer_line(layer: MoeLayer) -> str:
    """One MoE layer for people: its flips, margins and what the scores moved by."""
    near = f"tie band {layer.tie_band:.3g} ({layer.witness})"
    return (f"MoE layer {layer.layer}: {layer.apart} of {layer.num_tokens} tokens routed apart by trainer and engine "
            f"(against fp32: trainer {layer.trainer_flips}, engine {layer.engine_flips}); reference margin min "
            f"{layer.margin_min:.3g}, median {layer.margin_median:.3g}; score deviation p99 trainer "
            f"{layer.trainer_deviation:.3g}, engine {layer.engine_deviation:.3g}; {near}")


def flip_line(flip: RouterFlip) -> str:
    """One flipped token for people."""
    kind = "near tie" if flip.near_tie else "wide gap"
    a = f"A |Δ| {flip.a_diff:.3g}" if flip.a_diff is not None else "last token"
    return (f"seq {flip.sequence} pos {flip.position}: fp32 {flip.reference}, trainer {flip.trainer}, engine "
            f"{flip.engine}; margin {flip.margin:.3g} ({kind}); deviation trainer {flip.trainer_deviation:.3g}, "
            f"engine {flip.engine_deviation:.3g}; {a}")
