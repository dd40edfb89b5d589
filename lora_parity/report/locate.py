"""A `lora-parity locate` result for people: the per-point table's rows and the markdown section (pure rendering)."""

from __future__ import annotations

from lora_parity.evidence.locate_models import LocateResult, Point, SideAtPoint
from lora_parity.report.document import _md_link
from lora_parity.util import escape as esc
from lora_parity.verdict.locate_routes import flip_line, layer_line
from lora_parity.verdict.locate_rule import summary_line

HEADERS = ("point", "module", "trainer median", "engine median", "engine max", "fp32 vs fp64", "leaves")


def _g(x: float) -> str:
    return f"{x:.3g}"


def _side(at: SideAtPoint) -> str:
    d = at.distance.median
    return f"{_g(d.value)} ± {_g(d.se)} (≤ {_g(at.median_threshold)})"


def leaves(p: Point) -> str:
    """Which sides leave at the point ('' for none)."""
    return ", ".join(side for side in ("trainer", "engine") if getattr(p, side).leaves)


def rows(result: LocateResult) -> list[tuple[str, ...]]:
    """One row per point, in forward order (`HEADERS`): each side's median distance from fp32 with its standard
    error and its threshold, the engine's max, fp32's own distance from fp64 where measured."""
    out: list[tuple[str, ...]] = []
    for p in result.points:
        fp64 = _g(p.fp32_vs_fp64.median.value) if p.fp32_vs_fp64 is not None else "—"
        out.append((p.name, p.module, _side(p.trainer), _side(p.engine),
                    f"{_g(p.engine.distance.max.value)} (≤ {_g(p.engine.max_threshold)})", fp64, leaves(p)))
    return out


def headline(result: LocateResult) -> str:
    """The sentence a report opens with: where the sides part, on which sequences."""
    seqs = ", ".join(f"{s.index} (max |Δ| {s.max_abs:.3g})" for s in result.sequences)
    a = f"A failed ({', '.join(result.a_failed)})" if result.a_failed else "A passed"
    planted = f"; planted: {result.injected}" if result.injected else ""
    line = summary_line(result.divergences, result.points)
    return f"{line}. {a}; sequences {seqs}; {result.model} {result.dtype}{planted}"


MOE_HEADERS = ("MoE layer", "tokens", "apart", "trainer vs fp32", "engine vs fp32", "margin min", "margin median",
               "deviation p99 (trainer, engine)", "tie band")


def moe_headline(result: LocateResult) -> str | None:
    """What the routers did, in a sentence (None for a dense model)."""
    if result.moe_unavailable is not None:
        return f"MoE routing not compared: {result.moe_unavailable}"
    moe = result.moe
    if moe is None:
        return None
    apart = sum(layer.apart for layer in moe.layers)
    trainer = sum(layer.trainer_flips for layer in moe.layers)
    engine = sum(layer.engine_flips for layer in moe.layers)
    counts = (f"{apart} token-layer pair(s) routed apart by trainer and engine over {len(moe.layers)} MoE layer(s) "
              f"(against fp32: trainer {trainer}, engine {engine}; ranked by the {moe.ranking})")
    if apart + trainer + engine == 0:
        margin = min((layer.margin_min for layer in moe.layers), default=0.0)
        moved = max((max(layer.trainer_deviation, layer.engine_deviation) for layer in moe.layers), default=0.0)
        return (f"routing: zero flips: {counts}; smallest reference margin {margin:.3g}, the sides' scores within "
                f"{moved:.3g} of fp32 (p99)")
    if moe.listed_layer is None or moe.num_flips == 0:
        where = f"at layer {moe.listed_layer} ({moe.listed_because})" if moe.listed_layer is not None else ""
        return f"routing: {counts}; {where} no token flips".replace(";  no", "; no")
    near = sum(f.near_tie for f in moe.flips)
    return (f"routing: {counts}; at layer {moe.listed_layer} ({moe.listed_because}) {moe.num_flips} flipped "
            f"token(s); of the {len(moe.flips)} listed, {near} near a tie and {len(moe.flips) - near} across a wide "
            "gap")


def moe_lines(result: LocateResult) -> list[str]:
    """The routing for people, one line per MoE layer and per listed flip (none for a dense model)."""
    head = moe_headline(result)
    if head is None:
        return []
    moe = result.moe
    if moe is None:
        return [head]
    return [head, *(layer_line(layer) for layer in moe.layers),
            *(f"  flip at layer {moe.listed_layer}: {flip_line(flip)}" for flip in moe.flips)]


def _moe_markdown(result: LocateResult) -> list[str]:
    head = moe_headline(result)
    if head is None:
        return []
    lines = ["", "#### Routing (MoE)", "", esc.markdown(head)]
    moe = result.moe
    if moe is None:
        return lines
    lines += ["", "| " + " | ".join(MOE_HEADERS) + " |", "|" + "---|" * len(MOE_HEADERS)]
    for layer in moe.layers:
        row = (str(layer.layer), str(layer.num_tokens), str(layer.apart), str(layer.trainer_flips),
               str(layer.engine_flips), _g(layer.margin_min), _g(layer.margin_median),
               f"{_g(layer.trainer_deviation)}, {_g(layer.engine_deviation)}",
               f"{_g(layer.tie_band)} ({layer.witness})")
        lines.append("| " + " | ".join(esc.markdown(c) for c in row) + " |")
    if moe.flips:
        lines += ["", f"Flips at layer {moe.listed_layer}, A's worst tokens first:", ""]
        lines += [f"- {esc.markdown(flip_line(flip))}" for flip in moe.flips]
    return lines


def markdown(result: LocateResult, receipt: str, plot: str | None = None) -> str:
    """The markdown section: the headline, the rule, the per-point table (`plot`: a link to its PNG, shown above
    it), the routing of an MoE model."""
    lines = [f"### First divergence of the base forward: {esc.markdown(receipt)}", "",
             esc.markdown(headline(result)), "",
             f"Rule (docs/locate.md): a side leaves where its distance from fp32 exceeds {result.rule.balance:g} × "
             f"the precision witness's (the other side, or fp32 against fp64) beyond {result.rule.k:g} standard "
             "errors on both, by the median or the max over tokens.", "",
             *([f"![distance from fp32 per point]({_md_link(plot)})", ""] if plot is not None else []),
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(esc.markdown(c) for c in row) + " |" for row in rows(result)]
    lines += _moe_markdown(result)
    return "\n".join(lines) + "\n"
