"""All terminal output: rich for people (progress and hints on stderr, results on stdout), JSON for machines.

Paths and user text (config names, error messages, target names) are printed literally: they go
through `escape` (or `markup=False`), so `[/b]` or `c[red]` in a path is never read as rich markup.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lora_parity.checks import not_passing
from lora_parity.errors import ConfigError
from lora_parity.receipt import Receipt

err = Console(stderr=True, highlight=False, emoji=False)
out = Console(highlight=False, emoji=False)

_STYLE = {"pass": "green", "fail": "red", "inconclusive": "yellow", "error": "red", "not_reached": "dim",
          "ok": "green"}


def error(message: str) -> None:
    """One line on stderr."""
    print(f"lora-parity: error: {' '.join(message.split())}", file=sys.stderr)


def progress(phase: str, status: str, seconds: float) -> None:
    """One line per finished phase, on stderr."""
    err.print(f"  [{_STYLE.get(status, '')}]{status:>5}[/] {escape(f'{phase:<28}')} {seconds:8.2f} s")


def quiet_progress(phase: str, status: str, seconds: float) -> None:
    """Only errors and the backends' start, on stderr (selftest runs many sequences)."""
    if status != "ok" or phase in ("sampler.start", "trainer.load", "model"):
        progress(phase, status, seconds)


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def checks_table(receipt: Receipt) -> Table:
    """The checks with observed values and budgets."""
    table = Table(title=escape(f"{receipt.model.name}: {receipt.trainer.backend} trainer vs "
                               f"{receipt.sampler.backend} sampler"))
    for col in ("check", "observed", "", "budget", "status"):
        table.add_column(col, justify="right" if col in ("observed", "budget") else "left", no_wrap=True)
    for c in receipt.checks:
        style = _STYLE.get(c.status.value, "")
        table.add_row(escape(c.id), _fmt(c.observed), c.op, _fmt(c.budget), f"[{style}]{c.status.value}[/]")
    return table


def summary(receipt: Receipt, path: str) -> dict[str, Any]:
    """The machine-readable summary `--json` prints."""
    return {
        "verdict": receipt.verdict.value,
        "verdicts": receipt.verdicts.model_dump(mode="json") if receipt.verdicts else None,
        "receipt": path,
        "error": receipt.error,
        "failed_checks": [c.id for c in not_passing(receipt.checks, reached=True)],
        "checks": [{"id": c.id, "status": c.status.value, "observed": c.observed, "budget": c.budget, "op": c.op}
                   for c in receipt.checks],
        "comparisons": {k: {"mean_abs": v.mean_abs, "p99": v.p99, "max_abs": v.max_abs}
                        for k, v in receipt.comparisons.items()},
    }


def print_json(data: Any) -> None:
    """JSON on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def result(receipt: Receipt, path: str, as_json: bool) -> None:
    """The outcome of a run: the checks table and verdict, or the JSON summary."""
    if as_json:
        print_json(summary(receipt, path))
        return
    out.print(checks_table(receipt))
    style = _STYLE.get(receipt.verdict.value, "")
    error = f" ({escape(receipt.error)})" if receipt.error else ""
    out.print(f"verdict: [{style}]{receipt.verdict.value}[/]{error}")
    err.print(f"receipt: {path}", markup=False, soft_wrap=True)


def selftest_matrix(result: Any, as_json: bool) -> None:
    """The fault → expected → observed → caught matrix."""
    if as_json:
        print_json({"ok": result.ok, "repeats": result.repeats, "identical_repeats": result.identical_repeats,
                    "rows": [vars(r) for r in result.rows]})
        return
    table = Table(title="lora-parity selftest")
    for col in ("fault", "expected", "observed", "caught"):
        table.add_column(col, overflow="fold")
    for r in result.rows:
        table.add_row(escape(r.fault), escape(r.expected), escape(r.observed),
                      "[green]yes[/]" if r.caught else "[red]NO[/]")
    out.print(table)
    if result.repeats > 1:
        same = "bit-identical" if result.identical_repeats else "[red]NOT identical[/]"
        out.print(f"{result.repeats} clean runs: scores {same}")
    out.print("selftest: " + ("[green]ok[/]" if result.ok else "[red]FAILED[/]"))


def print_text(text: str) -> None:
    """Rendered text (markdown, plain text, JSON) on stdout as is, with no rich markup; UTF-8 whatever the locale."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        sys.stdout.write(text)
        return
    sys.stdout.flush()
    buffer.write(text.encode("utf-8"))
    buffer.flush()


def line(text: str) -> None:
    """Text on stdout, printed literally (no rich markup)."""
    out.print(text, markup=False, soft_wrap=True)


def hint(message: str) -> None:
    """One hint line on stderr."""
    print(f"lora-parity: {' '.join(message.split())}", file=sys.stderr)


def evidence_table(header: list[str], rows: list[list[str]]) -> None:
    """The evidence table as a rich table on stdout."""
    table = Table(title="lora-parity evidence")
    for col in header:
        table.add_column(col, overflow="fold")
    for row in rows:
        result = row[-1]
        style = "green" if result == "Pass" else "yellow" if result.startswith("Inconclusive") else "red"
        table.add_row(*(escape(c) for c in row[:-1]), f"[{style}]{escape(result)}[/]")
    out.print(table)


def github_summary(markdown: str) -> None:
    """Append `markdown` to the file named by $GITHUB_STEP_SUMMARY; without it, a hint on stderr."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        hint("--github-summary: GITHUB_STEP_SUMMARY is not set; nothing appended")
        return
    try:
        with open(target, "a", encoding="utf-8") as f:
            f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    except OSError as e:
        raise ConfigError(f"GITHUB_STEP_SUMMARY={target}: cannot append: {e.strerror or e}") from None
