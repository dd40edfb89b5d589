"""A `lora-parity locate` result for people: the per-point table's rows and the markdown section (pure rendering)."""

from __future__ import annotations

from lora_parity.evidence.locate_models import LocateResult, Point, SideAtPoint
from lora_parity.util import escape as esc
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
    return f"{summary_line(result.divergences)}. {a}; sequences {seqs}; {result.model} {result.dtype}{planted}"


def markdown(result: LocateResult, receipt: str) -> str:
    """The markdown section: the headline, the rule, the per-point table."""
    lines = [f"### First divergence of the base forward: {esc.markdown(receipt)}", "",
             esc.markdown(headline(result)), "",
             f"Rule (docs/locate.md): a side leaves where its distance from fp32 exceeds {result.rule.balance:g} × "
             f"the precision witness's (the other side, or fp32 against fp64) beyond {result.rule.k:g} standard "
             "errors on both, by the median or the max over tokens.", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(esc.markdown(c) for c in row) + " |" for row in rows(result)]
    return "\n".join(lines) + "\n"
