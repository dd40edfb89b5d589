"""All terminal output: rich for people (progress and hints on stderr, results on stdout), JSON for machines.

Paths and user text (config names, error messages, target names, anything a receipt brings) are
printed literally: they go through `lora_parity.util.escape` (`rich` inside markup, `terminal` otherwise),
so `[/b]` in a path is never read as rich markup and no escape sequence from a receipt reaches the screen.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from lora_parity.evidence.receipt import Receipt
from lora_parity.util import escape as esc
from lora_parity.util.errors import ConfigError
from lora_parity.util.escape import rich as escape
from lora_parity.verdict import explain, findings, lifecycle
from lora_parity.verdict.check_rules import compared_nothing, target_of
from lora_parity.verdict.checks import not_passing
from lora_parity.verdict.locate_rule import locate_hint


def _columns() -> int | None:
    """$COLUMNS where it is a usable width (rich prints nothing at all at 0); None: rich decides."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return None
    return columns if columns >= 20 else 80


for _stream in (sys.stdout, sys.stderr):  # a non-UTF-8 terminal gets '?' for '≤', never a crash after the run
    if hasattr(_stream, "reconfigure"):
        _stream.reconfigure(errors="replace")
err = Console(stderr=True, highlight=False, emoji=False, width=_columns())
out = Console(highlight=False, emoji=False, width=_columns())
if not out.is_terminal and "COLUMNS" not in os.environ:
    out.width = 1000  # piped or redirected: tables at their natural width, never wrapped at 80 columns

_STYLE = {"pass": "green", "fail": "red", "inconclusive": "yellow", "error": "red", "not_reached": "dim",
          "ok": "green"}


def error(message: str) -> None:
    """One line on stderr."""
    print(f"lora-parity: error: {esc.one_line(message)}", file=sys.stderr)


def progress(phase: str, status: str, seconds: float) -> None:
    """One line per finished phase, on stderr (`--verbose`)."""
    err.print(f"  [{_STYLE.get(status, '')}]{status:>5}[/] {escape(f'{phase:<28}')} {seconds:8.2f} s")


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _row(table: Table, c: Any) -> None:
    style = _STYLE.get(c.status.value, "")
    table.add_row(escape(c.id), explain.measure(c.id), _fmt(c.observed), c.op, _fmt(c.budget),
                  f"[{style}]{c.status.value}[/]")


def _equal_row(table: Table, receipt: Receipt, key: str) -> None:
    """The fraction of bitwise-equal tokens of a trainer-vs-sampler comparison (no check; `--budgets exact`
    makes A's and C's parity checks bitwise)."""
    cmp = receipt.comparisons.get(key)
    if cmp is not None and cmp.equal is not None:
        table.add_row(f"[dim]{escape(key)}[/]", "bitwise equal", f"{100 * cmp.equal:.4g} %", "", "", "")


def _reference_rows(table: Table, receipt: Receipt) -> None:
    """The fp32 reference beside A: how far each side's zero-init scores are from it (no checks)."""
    _equal_row(table, receipt, "A.trainer_vs_sampler")
    for key in ("R.trainer_vs_fp32", "R.sampler_vs_fp32"):
        cmp = receipt.comparisons.get(key)
        if cmp is not None:
            table.add_row(f"[dim]{escape(key)}[/]", "mean |diff|", _fmt(cmp.mean_abs), "", "",
                          f"[dim]max {_fmt(cmp.max_abs)}[/]")


def checks_table(receipt: Receipt, fold_passing_targets: bool = True) -> Table:
    """The checks with what each observed value is, and budgets; the fp32 reference (R.*) beside A;
    per-target checks folded into one row when they all pass."""
    title = f"{receipt.model.name}: {receipt.trainer.backend} trainer vs {receipt.sampler.backend} sampler"
    if receipt.injected_fault:
        title += f" · injected fault {receipt.injected_fault}"
    table = Table(title=escape(title))
    for col in ("check", "measure", "observed", "", "budget", "status"):
        table.add_column(col, justify="right" if col in ("observed", "budget") else "left", no_wrap=True)
    targets = [c for c in receipt.checks if c.id.startswith("T.")]
    fold = fold_passing_targets and targets and all(c.status.value == "pass" for c in targets)
    shown_reference = False
    for c in receipt.checks:
        if fold and c.id.startswith("T."):
            continue
        if not shown_reference and not c.id.startswith("A.parity"):
            _reference_rows(table, receipt)
            shown_reference = True
        _row(table, c)
        if c.id == "C.parity.max":
            _equal_row(table, receipt, "C.trainer_vs_sampler")
    if fold:
        kinds = {target_of(c.id) for c in targets}
        table.add_row(f"T.* ({len(targets)} checks)", f"{len(kinds)} targets", "", "", "", "[green]pass[/]")
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
        "comparisons": {k: {"mean_abs": v.mean_abs, "p99": v.p99, "max_abs": v.max_abs, "equal": v.equal}
                        for k, v in receipt.comparisons.items()},
        "lifecycle": [r.model_dump(mode="json") for r in _lifecycle(receipt)],
    }


def _lifecycle(receipt: Receipt) -> list[Any]:
    return list(receipt.lifecycle) if receipt.lifecycle is not None else lifecycle.of_receipt(receipt)


def not_covered_line(receipt: Receipt) -> str | None:
    """'not covered (the engine as deployed): CUDA graphs, ...': the lifecycle conditions this run did not
    exercise, said outright (never implied as a pass); None when every one was covered."""
    missing = [r.condition for r in lifecycle.not_covered(_lifecycle(receipt))]
    if not missing:
        return None
    return f"not covered (the engine as deployed; not a pass): {', '.join(missing)} - see the report's table"


def print_json(data: Any) -> None:
    """JSON on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def counts(statuses: list[str]) -> str:
    """pytest-style counts: '35 passed, 2 failed, 1 inconclusive' (zero counts left out but 'passed')."""
    names = (("pass", "passed"), ("fail", "failed"), ("inconclusive", "inconclusive"), ("not_reached", "not reached"))
    parts = [f"{statuses.count(s)} {word}" for s, word in names if s == "pass" or statuses.count(s)]
    return ", ".join(parts)


def closing_line(receipt: Receipt, path: str, seconds: float) -> str:
    """The last line of a run, pytest-style: 'fail: 35 passed, 2 failed in 29.1 s · receipt PATH'."""
    verdict = receipt.verdict.value
    error = f" ({' '.join(receipt.error.split())})" if receipt.error else ""
    return (f"{verdict}{error}: {counts([c.status.value for c in receipt.checks])} in {seconds:.1f} s"
            f" · receipt {path}")


def _fault_line(receipt: Receipt) -> str | None:
    if not receipt.injected_fault:
        return None
    from lora_parity.run.faults import FAULTS

    name = receipt.injected_fault.partition("=")[0]
    spec = FAULTS.get(name)
    if spec is None:
        return f"injected fault: {receipt.injected_fault}"
    caught = (f", caught by {' and '.join(c.replace('|', ' or ') for c in spec.caught_by)}"
              if spec.caught_by else "")
    return f"injected fault: {receipt.injected_fault} ({spec.description}); expected: {spec.verdict}{caught}"


def explanations(receipt: Receipt) -> list[str]:
    """One line per failing or inconclusive check (checks that mean the same thing share a line): the
    observed value against its budget, what it means, and what to look at next; one per check not run
    because it compared nothing, and why."""
    groups: dict[tuple[str, str], list[Any]] = {}
    failing = not_passing(receipt.checks, reached=True)
    ids = frozenset(c.id for c in failing)
    for c in failing:
        groups.setdefault((c.status.value, explain.line(c, ids)), []).append(c)
    lines = []
    for (status, meaning), group in groups.items():
        c = group[0]
        if c.observed is None:
            observed = "undefined"
        elif status == "inconclusive":
            observed = f"{_fmt(c.observed)}, threshold {c.op} {_fmt(c.budget)}"
        else:
            observed = f"{_fmt(c.observed)} not {c.op} {_fmt(c.budget)}"
        names = ", ".join(x.id for x in group)
        lines.append(f"{status} {names} ({explain.measure(c.id) or 'observed'} {observed}): {meaning}")
    for c in (c for c in receipt.checks if compared_nothing(c)):  # not run: no check passes on nothing
        lines.append(f"not run {c.id}: {c.reason.removeprefix('not run: ')}; a comparison over nothing verifies "
                     "nothing, so the run cannot pass")
    return lines


def _verdicts_line(receipt: Receipt) -> str | None:
    """'sync: fail (C.parity.mean, ...) · numerics: pass': which half of the verdict failed, and on what."""
    if receipt.verdicts is None or receipt.verdict.value == "pass":
        return None
    parts = []
    for name, group in (("sync", receipt.verdicts.sync), ("numerics", receipt.verdicts.numerics)):
        ids = group.decided_by
        shown = ", ".join(ids[:3]) + (f" (+{len(ids) - 3} more)" if len(ids) > 3 else "")
        failing = group.verdict.value != "pass" and shown
        parts.append(f"{name}: {group.verdict.value}" + (f" ({shown})" if failing else ""))
    return (" · ".join(parts) + " - sync judges delivery (did the trainer's tensors reach the engine, after and "
            "only after the sync), numerics the computation (A; and C, T, G where X proved the delivery)")


def result(receipt: Receipt, path: str, as_json: bool, seconds: float = 0.0, log: str | None = None,
           quiet: bool = False) -> None:
    """The outcome of a run: the checks table, one line per failing check, the injected fault, and a
    closing line; with `quiet` only the closing line; or the JSON summary."""
    if as_json:
        print_json(summary(receipt, path))
        return
    if not quiet:
        out.print(checks_table(receipt))
        notes = [n for n in (_fault_line(receipt), _verdicts_line(receipt)) if n] + findings.of_receipt(receipt) \
            + explanations(receipt)
        if receipt.error:
            notes.append(f"error: {receipt.error}")
        for note in notes:
            line(note)
        if notes:
            line(f"next: lora-parity report {path}  (worst positions, error breakdown, every comparison)")
        located = locate_hint(receipt.checks, path)
        if located:
            line(located)
        if log:
            line(f"third-party logs: {log}")
        uncovered = not_covered_line(receipt)
        if uncovered:
            line(uncovered)
    style = _STYLE.get(receipt.verdict.value, "")
    text = closing_line(receipt, path, seconds)
    verdict, _, rest = text.partition(":")
    out.print(f"[{style}]{escape(verdict)}[/]:{escape(rest)}", soft_wrap=True)


def selftest_row(row: Any, with_seed: bool = False) -> str:
    """One selftest run as rich markup: caught or not, the fault (and its seed, `with_seed`), what was
    observed (an expected error labelled as such), the seconds it took."""
    mark = "[green]caught[/]" if row.caught else "[red]MISSED[/]"
    if row.fault.startswith("none"):
        mark = "[green]  pass[/]" if row.caught else "[red]  FAIL[/]"
    observed = row.observed
    if row.expected_error:
        observed = "expected error: " + observed.removeprefix("error: ")
    elif not row.caught:
        observed += f" (expected {row.expected})"
    if row.restarted:
        observed += f"; {row.restarted}"
    seed = f"seed {row.seed:<3} " if with_seed else ""
    return f"  {mark} {seed}{escape(f'{row.fault:<20}')} {escape(observed)} [dim]{row.seconds:.1f} s[/]"


def selftest_watcher(session: Any, seeds: int = 1) -> Any:
    """The selftest's `watch` callback: the live line names the running fault; each result is a line."""
    def watch(fault: str, row: Any) -> None:
        if row is None:
            session.status(f"fault {fault}" if not fault.startswith("none") else "clean run")
        else:
            session.note(selftest_row(row, seeds > 1))
    return watch


def _margin(x: float | None) -> str:
    return "—" if x is None else "inf" if x == float("inf") else f"{x:.3g}"


def _json_number(x: float | None) -> float | None:
    """A margin for JSON: an infinite one (past a zero threshold) becomes null, as an undefined one."""
    return None if x is None or x == float("inf") else x


def selftest_json(result: Any) -> dict[str, Any]:
    """The selftest as data: every run, the false-alarm rate of the clean runs, and per fault caught k of
    N seeds with the closest call (margins: docs/verdicts.md; null where infinite or undefined)."""
    clean = result.clean_rows
    near = result.clean_closest()
    return {
        "ok": result.ok, "seeds": result.seeds, "repeats": result.repeats,
        "identical_repeats": result.identical_repeats, "left_out": dict(result.left_out),
        "false_alarms": {"count": result.false_alarms, "runs": len(clean),
                         "rate": result.false_alarms / len(clean) if clean else None,
                         "closest": None if near is None else {"margin": _json_number(near.margin),
                                                               "check": near.margin_check, "seed": near.seed}},
        "faults": [{"fault": t.fault, "expected": t.expected, "caught": t.caught, "runs": t.runs,
                    "closest": None if t.closest_check is None else {
                        "margin": _json_number(t.closest), "check": t.closest_check, "seed": t.closest_seed}}
                   for t in result.tallies()],
        "rows": [{k: _json_number(v) if k == "margin" else v for k, v in vars(r).items() if k != "seconds"}
                 for r in result.rows],
    }


def seeds_line(result: Any) -> str:
    """The closing line of a selftest over several seeds: false alarms, faults caught in every seed, and
    the closest call (or what was missed)."""
    tallies = result.tallies()
    every = [t for t in tallies if t.caught == t.runs]
    text = (f"selftest {'ok' if result.ok else 'FAILED'}, {len(result.seeds)} seeds: {result.false_alarms}/"
            f"{len(result.clean_rows)} false alarms; {len(every)}/{len(tallies)} faults caught in every seed")
    missed = [f"{t.fault} {t.runs - t.caught}/{t.runs}" for t in tallies if t.caught < t.runs]
    finite = [t for t in tallies if t.closest is not None and t.closest != float("inf")]
    if missed:
        text += f" (missed: {', '.join(missed)})"
    elif finite:
        t = min(finite, key=lambda t: t.closest)
        text += f" (closest: {t.fault} {t.closest_check} margin {_margin(t.closest)})"
    if not result.identical_repeats:
        text += "; repeated clean runs NOT identical"
    return text


def _seeds_table(result: Any) -> Table:
    table = Table(title=f"selftest over {len(result.seeds)} seeds ({', '.join(map(str, result.seeds))})")
    for col in ("run", "expected", "caught", "closest margin", "check", "seed"):
        table.add_column(col, justify="right" if col in ("caught", "closest margin", "seed") else "left")
    clean, near = result.clean_rows, result.clean_closest()
    passed = len(clean) - result.false_alarms
    table.add_row("clean", "pass", f"[{'green' if not result.false_alarms else 'red'}]{passed}/{len(clean)}[/]",
                  _margin(near.margin if near else None), escape(near.margin_check or "") if near else "",
                  str(near.seed) if near else "")
    for t in result.tallies():
        style = "green" if t.caught == t.runs else "red"
        table.add_row(escape(t.fault), escape(t.expected), f"[{style}]{t.caught}/{t.runs}[/]", _margin(t.closest),
                      escape(t.closest_check or ""), "" if t.closest_seed is None else str(t.closest_seed))
    return table


def selftest_summary(result: Any, as_json: bool, seconds: float = 0.0, log: str | None = None) -> None:
    """After the rows printed as they ran: the repeats, the log, and one closing line; over several seeds
    the table of rates and margins first, and a closing line that sums them up."""
    if as_json:
        print_json(selftest_json(result))
        return
    many = len(result.seeds) > 1
    faults = [r for r in result.rows if not r.fault.startswith("none")]
    clean = [r for r in result.rows if r.fault.startswith("none")]
    for r in result.rows:
        if not r.caught:
            out.print(selftest_row(r, many), soft_wrap=True)
    if many:
        out.print(_seeds_table(result))
    if result.repeats > 1:
        same = "bit-identical" if result.identical_repeats else "[red]NOT identical[/]"
        out.print(f"{result.repeats} clean runs{' per seed' if many else ''}: scores {same}")
    for fault, why in result.left_out.items():
        out.print(f"left out (the started engine cannot take it): {escape(fault)}: {escape(why)}", soft_wrap=True)
    if log:
        line(f"third-party logs: {log}")
    if many:
        text = seeds_line(result)
        style = "green" if result.ok else "red"
        head, _, rest = text.partition(":")
        out.print(f"[{style}]{escape(head)}[/]:{escape(rest)} in {seconds:.1f} s", soft_wrap=True)
        return
    verdict = "[green]selftest ok[/]" if result.ok else "[red]selftest FAILED[/]"
    out.print(f"{verdict}: {sum(r.caught for r in clean)} of {len(clean)} clean runs passed, "
              f"{sum(r.caught for r in faults)} of {len(faults)} faults caught in {seconds:.1f} s", soft_wrap=True)


def print_text(text: str) -> None:
    """Rendered text (markdown, plain text, JSON) on stdout as is, with no rich markup; UTF-8 whatever the locale."""
    text = esc.terminal(text)
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:
        sys.stdout.write(text)
        return
    sys.stdout.flush()
    buffer.write(text.encode("utf-8"))
    buffer.flush()


def line(text: str) -> None:
    """Text on stdout, printed literally (no rich markup)."""
    out.print(esc.terminal(text), markup=False, soft_wrap=True)


def hint(message: str) -> None:
    """One hint line on stderr."""
    print(f"lora-parity: {esc.one_line(message)}", file=sys.stderr)


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
    try:  # a regular file only: a FIFO there would block the job forever, a device take the text
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(f"GITHUB_STEP_SUMMARY={target}: not a regular file")
            f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    except OSError as e:
        raise ConfigError(f"GITHUB_STEP_SUMMARY={target}: cannot append: {e.strerror or e}") from None
