"""PNG plots of |diff| per scored position for checks A, B (the stimulus) and C, with budgets drawn.

matplotlib is imported only when a plot is drawn, and only its Agg canvas is used (headless, no
pyplot global state). Position t of sequence s scores token probes.sequences[s][t+1]; sequences are
concatenated along the x axis with a dotted line between them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lora_parity.errors import BackendUnavailableError
from lora_parity.receipt import Receipt
from lora_parity.report.facts import group_status, position_diffs, worst_diffs

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


def _budget_lines(receipt: Receipt, name: str) -> list[tuple[float, str, str, str]]:
    """(value, label, colour, line style) of every threshold the comparison is checked against."""
    b = receipt.budgets
    if name.startswith("B."):
        return [(b.min_stimulus, f"min_stimulus {b.min_stimulus:g} (mean must reach it)", "tab:green", "-")]
    return [(b.mean, f"mean budget {b.mean:g}", "tab:orange", "-"),
            (b.p99, f"p99 budget {b.p99:g}", "tab:red", "--"),
            (b.max, f"max budget {b.max:g}", "tab:red", "-")]


def draw(receipt: Receipt, name: str, path: Path) -> Path:
    """Draw comparison `name` of `receipt` to the PNG `path`."""
    Figure, FigureCanvasAgg = _matplotlib()
    cmp = receipt.comparisons[name]
    positions = position_diffs(receipt, name)
    absd = [abs(p.diff) for p in positions]
    lines = _budget_lines(receipt, name)
    nonzero = [v for v in absd if v > 0]
    # A log axis shows 1e-6 agreement and a 9-nat outlier on one plot; exact zeros sit on the floor.
    floor = min([*nonzero, *(v for v, *_ in lines)]) / 10

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = list(range(len(absd)))
    ax.plot([x for x, v in zip(xs, absd, strict=True) if v > 0], nonzero, ".", ms=3, color="tab:blue",
            label=f"|{cmp.b} − {cmp.a}|")
    zeros = [x for x, v in zip(xs, absd, strict=True) if v == 0]
    if zeros:
        ax.plot(zeros, [floor] * len(zeros), "|", ms=4, color="0.6", label=f"exactly 0 ({len(zeros)} positions)")
    for value, label, colour, style in lines:
        ax.axhline(value, color=colour, ls=style, lw=1, label=label)
    ax.axhline(max(cmp.mean_abs, floor), color="tab:blue", ls=":", lw=1, label=f"observed mean {cmp.mean_abs:.3g}")
    start = 0
    for seq in receipt.scores[cmp.a][:-1]:
        start += len(seq)
        ax.axvline(start - 0.5, color="0.8", ls=":", lw=0.8)
    worst = worst_diffs(receipt, name, k=1)
    if worst:
        w = worst[0]
        x = xs[sum(len(s) for s in receipt.scores[cmp.a][: w.sequence]) + w.position]
        ax.annotate(f"s{w.sequence} t{w.position} tok {w.token_id}", (x, abs(w.diff)), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, max([*absd, *(v for v, *_ in lines)]) * 3)
    ax.set_xlim(-1, len(absd))
    status = group_status(receipt.checks, name[0])
    ax.set_title(f"{PLOTTED.get(name, name)} ({status.value if status else 'not checked'})", fontsize=10)
    ax.set_xlabel("scored position (sequences concatenated)", fontsize=8)
    ax.set_ylabel("|Δ logprob| (nats)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})
    return path


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
