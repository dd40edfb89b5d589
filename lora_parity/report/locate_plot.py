"""The per-layer plot of a `lora-parity locate` result (`--plot DIR`, docs/locate.md): each side's median distance
from the fp32 reference at every point of the forward, in forward order, on a log axis, with what precision explains
there (fp32 against fp64, where measured) and each side's threshold as lines, and the point each side leaves at
marked. matplotlib's Agg canvas only, imported when drawn (`plots._matplotlib`); written through `safe_write`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lora_parity.evidence.locate_models import LocateResult
from lora_parity.report.plots import DPI, _matplotlib
from lora_parity.util import safe_write

FIGSIZE = (10.0, 4.2)
MAX_LABELS = 24
"""At most this many points are labelled on the x axis (the others every few layers)."""
SIDES = (("trainer", "tab:blue", "o"), ("engine", "tab:red", "s"))


def file_name(receipt: Path) -> str:
    """`NAME.locate.png` for the receipt `NAME.json`."""
    return f"{receipt.stem if receipt.suffix == '.json' else receipt.name}.locate.png"


def _labelled(names: list[str]) -> list[int]:
    """Which points get a label: all where few, else the embedding, the final norm and every few layers' output."""
    if len(names) <= MAX_LABELS:
        return list(range(len(names)))
    layers = [i for i, n in enumerate(names) if n.startswith("layers.") and n.count(".") == 1]
    step = max(1, math.ceil(len(layers) / (MAX_LABELS - 2)))
    return sorted({0, len(names) - 1, *layers[::step]})


def figure(result: LocateResult) -> Any:
    """The matplotlib Figure: per point, the trainer's and the engine's median distance from fp32 (markers and
    line), their median thresholds (dashed), fp32 against fp64 (grey, the witness of an fp32 checkpoint), and a
    vertical line at each side's first departure. Exact zeros sit on the axis floor, marked as such."""
    Figure, FigureCanvasAgg = _matplotlib()
    names = [p.name for p in result.points]
    xs = list(range(len(names)))
    series = {side: [getattr(p, side).distance.median.value for p in result.points] for side, _, _ in SIDES}
    thresholds = {side: [getattr(p, side).median_threshold for p in result.points] for side, _, _ in SIDES}
    fp64 = [p.fp32_vs_fp64.median.value if p.fp32_vs_fp64 is not None else None for p in result.points]
    shown = [v for vs in (*series.values(), *thresholds.values(), fp64) for v in vs if v is not None and v > 0]
    floor = min(shown) / 10 if shown else 1e-9

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for side, colour, marker in SIDES:
        values = series[side]
        ax.plot(xs, [max(v, floor) for v in values], marker=marker, ms=3.5, lw=1.0, color=colour,
                label=f"{side}: median distance from fp32")
        zeros = [x for x in xs if values[x] == 0]
        if zeros:
            ax.plot(zeros, [floor] * len(zeros), "|", ms=7, color=colour, label=f"{side}: exactly 0 ({len(zeros)})")
        ax.plot(xs, [max(v, floor) for v in thresholds[side]], ls="--", lw=0.9, color=colour, alpha=0.8,
                label=f"{side}: threshold (x{result.rule.balance:g} the witness + {result.rule.k:g} se)")
    measured = [(x, v) for x, v in zip(xs, fp64, strict=True) if v is not None]
    if measured:
        ax.plot([x for x, _ in measured], [max(v, floor) for _, v in measured], ls=":", lw=1.4, color="0.4",
                label="witness: fp32 reference vs fp64")
    for d in result.divergences:
        x = names.index(d.point)
        colour = dict((s, c) for s, c, _ in SIDES)[d.side]
        ax.axvline(x, color=colour, lw=1.2, alpha=0.6)
        ax.annotate(f"{d.side} leaves: {d.point}", (x, 1), xycoords=("data", "axes fraction"), xytext=(3, -4),
                    textcoords="offset points", fontsize=7, color=colour, va="top", rotation=90)
    labelled = _labelled(names)
    ax.set_xticks(labelled)
    ax.set_xticklabels([names[i] for i in labelled], rotation=60, ha="right", fontsize=6.5)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, max([*shown, floor]) * 6)
    ax.set_xlim(-0.5, len(names) - 0.5)
    named = "; ".join(f"{d.side} at {d.point}" for d in result.divergences) or "no layer named"
    ax.set_title(f"{result.model} ({result.dtype}): distance from the fp32 reference per point ({named})", fontsize=9)
    ax.set_ylabel("relative L2 from fp32, median over tokens", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def draw(result: LocateResult, path: Path) -> Path:
    """Draw `figure(result)` to the PNG `path` (its folder created), never through a link planted there."""
    fig = figure(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    return safe_write.write_png(path, fig)
