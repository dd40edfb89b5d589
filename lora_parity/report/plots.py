"""PNG plots of |diff| per scored position for checks A, B (the stimulus) and C, with the thresholds that
decided their checks drawn (each check's recorded budget, derived or fixed).

matplotlib is imported only when a plot is drawn, and only its Agg canvas is used (headless, no
pyplot global state). Position t of sequence s scores token probes.sequences[s][t+1]; sequences are
concatenated along the x axis with a dotted line between them, each labelled at the top.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lora_parity.evidence.receipt import Receipt
from lora_parity.report.facts import (
    HEADLINE_CHECKS,
    OP_SIGNS,
    checks_by_id,
    group_status,
    position_diffs,
    start_point,
    worst_diffs,
)
from lora_parity.util import safe_write
from lora_parity.util.errors import BackendUnavailableError

PLOTTED: dict[str, str] = {
    "A.trainer_vs_sampler": "A zero-init: trainer vs sampler",
    "B.trainer_updated_vs_stale": "B stimulus: updated trainer vs stale sampler",
    "C.trainer_vs_sampler": "C after sync: updated trainer vs synced sampler",
}
"""Comparison → plot title; the file is `<comparison>.png`."""
FIGSIZE = (9.0, 3.6)
DPI = 110


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise BackendUnavailableError(
            "--plots needs matplotlib; install it with: pip install 'lora-parity[dev]'"
        ) from None
    return Figure, FigureCanvasAgg


_LINE_STYLES = {"mean": ("tab:orange", "-"), "p99": ("tab:red", "--"), "max": ("tab:red", "-"),
                "stimulus": ("tab:green", "-")}


def _budget_lines(receipt: Receipt, name: str) -> list[tuple[float, str, str, str]]:
    """(value, label, colour, line style) of every threshold that decided a check of the comparison,
    read off the checks themselves (a derived threshold is drawn where it was, not the config's budget)."""
    lines = []
    for check in checks_by_id(receipt, HEADLINE_CHECKS.get(name[0], ())):
        if check.budget is not None and check.budget > 0:
            colour, style = _LINE_STYLES[check.id.rsplit(".", 1)[-1]]
            lines.append((check.budget, f"{check.id} {OP_SIGNS[check.op]} {check.budget:.3g} (decided)", colour,
                          style))
    return lines


def _reference_series(receipt: Receipt, name: str) -> list[tuple[str, list[float]]]:
    """For A with `--reference fp32`: each side's |diff| from the fp32 base model, per position."""
    if not name.startswith("A."):
        return []
    series = []
    for ref, side in (("R.trainer_vs_fp32", "trainer"), ("R.sampler_vs_fp32", "sampler")):
        if ref in receipt.comparisons:
            series.append((f"|{side} − fp32 reference|", [abs(p.diff) for p in position_diffs(receipt, ref)]))
    return series


def _draw_points(ax: Any, absd: list[float], floor: float, label: str) -> None:
    xs = range(len(absd))
    ax.plot([x for x in xs if absd[x] > 0], [v for v in absd if v > 0], ".", ms=3, color="tab:blue", label=label,
            zorder=3)
    zeros = [x for x in xs if absd[x] == 0]
    if zeros:
        ax.plot(zeros, [floor] * len(zeros), "|", ms=4, color="0.6", label=f"exactly 0 ({len(zeros)} positions)")


def _draw_reference(ax: Any, series: list[tuple[str, list[float]]], floor: float) -> None:
    for (label, values), marker, colour in zip(series, ("x", "+"), ("tab:green", "tab:purple"), strict=False):
        ax.plot(range(len(values)), [max(v, floor) for v in values], marker, ms=3, mew=0.7, color=colour,
                alpha=0.7, label=label, zorder=2)


def _draw_thresholds(ax: Any, lines: list[tuple[float, str, str, str]], observed_mean: float, floor: float) -> None:
    # Budgets are thin and labelled on the line itself; the observed mean is a thick black dash-dot
    # line, so it never reads as a budget even where it lies close to one.
    for value, label, colour, style in lines:
        ax.axhline(value, color=colour, ls=style, lw=0.9, label=label, zorder=1)
        ax.annotate(label.split(" (")[0], (0, value), xycoords=("axes fraction", "data"), xytext=(3, 2),
                    textcoords="offset points", fontsize=6, color=colour, va="bottom")
    mean = max(observed_mean, floor)
    ax.axhline(mean, color="black", ls="-.", lw=1.6, label=f"observed mean {observed_mean:.3g}", zorder=4)
    ax.annotate(f"observed mean {observed_mean:.3g}", (1, mean), xycoords=("axes fraction", "data"),
                xytext=(-3, -2), textcoords="offset points", fontsize=6.5, ha="right", va="top", fontweight="bold")


def _draw_sequences(ax: Any, lengths: list[int]) -> None:
    """A dotted line between sequences and each sequence's label at the top."""
    start = 0
    for s, n in enumerate(lengths):
        if s:
            ax.axvline(start - 0.5, color="0.55", ls=":", lw=0.9)
        ax.annotate(f"seq {s} ({n} positions)", (start + n / 2, 1), xycoords=("data", "axes fraction"),
                    xytext=(0, -3), textcoords="offset points", fontsize=6.5, ha="center", va="top", color="0.35")
        start += n


def figure(receipt: Receipt, name: str) -> Any:
    """The matplotlib Figure of comparison `name`: |diff| per position, the budgets (thin, labelled),
    the observed mean (thick black dash-dot), each side's distance from the fp32 reference where the
    receipt has one (A only), and the sequence boundaries, labelled."""
    Figure, FigureCanvasAgg = _matplotlib()
    cmp = receipt.comparisons[name]
    absd = [abs(p.diff) for p in position_diffs(receipt, name)]
    lines = _budget_lines(receipt, name)
    reference = _reference_series(receipt, name)
    shown = [v for v in absd if v > 0] + [v for _, vs in reference for v in vs if v > 0]
    # A log axis shows 1e-6 agreement and a 9-nat outlier on one plot; exact zeros sit on the floor.
    scale = [*shown, *(v for v, *_ in lines)] or [1e-6]  # all exactly 0 and no threshold: any axis will do
    floor = min(scale) / 10

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw_points(ax, absd, floor, f"|{cmp.b} − {cmp.a}|")
    _draw_reference(ax, reference, floor)
    _draw_thresholds(ax, lines, cmp.mean_abs, floor)
    _draw_sequences(ax, [len(seq) for seq in receipt.scores[cmp.a]])
    worst = worst_diffs(receipt, name, k=1)
    if worst:
        w = worst[0]
        x = sum(len(s) for s in receipt.scores[cmp.a][: w.sequence]) + w.position
        right = x > len(absd) / 2
        ax.annotate(f"worst: seq {w.sequence} pos {w.position} tok {w.token_id}", (x, abs(w.diff)), fontsize=6.5,
                    xytext=(-4 if right else 4, 4), textcoords="offset points", ha="right" if right else "left")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, max(scale) * 6)
    ax.set_xlim(-1, len(absd))
    status = group_status(receipt.checks, name[0])
    title = start_point(receipt, PLOTTED.get(name, name))
    ax.set_title(f"{title} ({status.value if status else 'not checked'})", fontsize=10)
    ax.set_xlabel("scored position (sequences concatenated, in order)", fontsize=8)
    ax.set_ylabel("|Δ logprob| (nats)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def draw(receipt: Receipt, name: str, path: Path) -> Path:
    """Draw comparison `name` of `receipt` (see `figure`) to the PNG `path`."""
    fig = figure(receipt, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    return safe_write.write_png(path, fig)  # never through a link planted at the plot's path


def write_plots(receipt: Receipt, directory: Path) -> dict[str, Path]:
    """Draw A, the B stimulus and C (those the run reached) into `directory`; comparison → file."""
    _matplotlib()
    return {name: draw(receipt, name, Path(directory) / f"{name}.png")
            for name in PLOTTED if name in receipt.comparisons}


def link(path: Path) -> str:
    """A relative link to `path` (relative to the working directory when `path` is absolute)."""
    if path.is_absolute():
        try:
            return Path(os.path.relpath(path)).as_posix()
        except ValueError:  # another drive on Windows
            return path.as_posix()
    return path.as_posix()
