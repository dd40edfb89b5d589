"""What the report, the table and the plots read off a verified receipt: the headline comparisons,
per-position differences, worst positions, group statuses and one-line outcomes.

Token alignment is stated once in `lora_parity.verdict.stats`: the token scored at position t of sequence s
is `probes.sequences[s][t + 1]`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from lora_parity.evidence.receipt import Check, CheckStatus, Receipt, Verdict, WorstPosition
from lora_parity.report.document import clip, fmt_budget
from lora_parity.verdict import checks as checks_mod
from lora_parity.verdict import stats

NUM_WORST = 3
"""Worst positions listed per comparison."""
NOT_REACHED = "Not reached"

# The three comparisons behind checks A, B and C, in the order people read them.
HEADLINE: dict[str, tuple[str, str]] = {
    "A": ("A.trainer_vs_sampler", "zero-init trainer vs sampler"),
    "B": ("B.trainer_updated_vs_stale", "updated trainer vs stale sampler"),
    "C": ("C.trainer_vs_sampler", "updated trainer vs synced sampler"),
}
CHECK_TITLES = {"A": "A zero-init", "B": "B before sync", "C": "C after sync", "T": "T per target"}
HEADLINE_CHECKS: dict[str, tuple[str, ...]] = {
    "A": ("A.parity.mean", "A.parity.p99", "A.parity.max"),
    "B": ("B.stimulus",),
    "C": ("C.parity.mean", "C.parity.p99", "C.parity.max"),
}
"""The checks that judge each headline comparison; their recorded budgets are the thresholds that decided."""
OP_SIGNS = {"<=": "≤", ">=": "≥", ">": ">"}
_STATUS_RANK = {CheckStatus.FAIL: 3, CheckStatus.INCONCLUSIVE: 2, CheckStatus.NOT_REACHED: 1, CheckStatus.PASS: 0}


# --- what the run started from, and who signed it -----------------------------------------------------


def has_start_adapter(receipt: Receipt) -> bool:
    """Whether both sides started from a user's adapter (`run --adapter`) rather than zero-init."""
    return "adapter_base" in receipt.scores or "A.sampler_base_vs_adapter" in receipt.comparisons


def start_point(receipt: Receipt, text: str) -> str:
    """`text` with "zero-init" read as "start adapter" for a run that started from a user's adapter."""
    return text.replace("zero-init", "start adapter") if has_start_adapter(receipt) else text


def signature_note(status: str | None) -> str:
    """What the reader may trust about who made the receipt, from `verify`'s signature status:
    'signed (key id …)', 'signed, signature not checked …' or 'unsigned'."""
    if status is None or status == "unsigned":
        return "unsigned"
    if status == "not checked":
        return "signed, signature not checked (give --public-key to check it)"
    match = re.search(r"keyid ([0-9a-f]+)", status)
    return f"signed (key id {match.group(1) if match else '?'})"


# --- per-position differences ------------------------------------------------------------------------


@dataclass(frozen=True)
class Position:
    """One scored position of a comparison: diff = scores[b][s][t] - scores[a][s][t]."""

    sequence: int
    position: int
    token_id: int
    """The token scored at this position: probes.sequences[sequence][position + 1]."""
    diff: float


def position_diffs(receipt: Receipt, comparison: str) -> list[Position]:
    """Every position of a recorded comparison in sequence order, with the token it scores."""
    cmp = receipt.comparisons[comparison]
    a, b, seqs = receipt.scores[cmp.a], receipt.scores[cmp.b], receipt.probes.sequences
    return [
        Position(s, t, seqs[s][t + 1], y - x)
        for s, (row_a, row_b) in enumerate(zip(a, b, strict=True))
        for t, (x, y) in enumerate(zip(row_a, row_b, strict=True))
    ]


def _ranked(receipt: Receipt, comparison: str, k: int) -> list[WorstPosition]:
    """The receipt's own worst positions of `comparison` (recorded at the run, re-checked by verify);
    for a receipt without that record, or one that kept fewer than `k`, the same ranking from its scores."""
    recorded = (receipt.worst_positions or {}).get(comparison)
    if recorded is not None and len(recorded) >= k:
        return recorded[:k]
    cmp = receipt.comparisons[comparison]
    ranked = stats.worst_positions(receipt.scores[cmp.a], receipt.scores[cmp.b], receipt.probes.sequences, k)
    return [WorstPosition(**w) for w in ranked]  # type: ignore[arg-type]


def worst_diffs(receipt: Receipt, comparison: str, k: int = NUM_WORST) -> list[Position]:
    """The `k` positions with the largest |diff| (ties: earliest first), each with its signed diff;
    none where the diff is exactly 0."""
    cmp = receipt.comparisons[comparison]
    a, b = receipt.scores[cmp.a], receipt.scores[cmp.b]
    return [Position(w.sequence, w.position, w.token, b[w.sequence][w.position] - a[w.sequence][w.position])
            for w in _ranked(receipt, comparison, k) if w.abs_diff != 0]


# --- checks -------------------------------------------------------------------------------------------


def group_of(check_id: str) -> str:
    """The check's group: 'A', 'B', 'C', 'T' or 'S'."""
    return check_id.split(".", 1)[0]


def group_status(checks: Iterable[Check], group: str) -> CheckStatus | None:
    """The worst status among the checks of one group (A, B, C, T); None if it has none."""
    statuses = [c.status for c in checks if group_of(c.id) == group]
    return max(statuses, key=_STATUS_RANK.__getitem__) if statuses else None


def checks_by_id(receipt: Receipt, ids: Iterable[str]) -> list[Check]:
    """The receipt's checks with these ids, in the order given (missing ones left out)."""
    by_id = {c.id: c for c in receipt.checks}
    return [by_id[i] for i in ids if i in by_id]


def threshold(check: Check) -> str:
    """The threshold that decided `check`, as recorded in it ('≤ 0.0001'); '—' without one."""
    return f"{OP_SIGNS[check.op]} {fmt_budget(check.budget)}" if check.budget is not None else "—"


def short_reason(check: Check) -> str:
    """The check's failure reason without the numbers ('zero-init trainer vs sampler disagree')."""
    reason = re.sub(r": [^:]* not (<=|>=|>) [^:]*$", "", check.reason)
    return re.sub(r" \(undefined: [^)]*\)$", "", reason)


def outcome(receipt: Receipt) -> str:
    """The evidence table's Result: 'Pass', 'Fails A: <reason>', 'Inconclusive: <reason>' or 'Error: <message>'."""
    if receipt.verdict == Verdict.PASS:
        return "Pass"
    if receipt.verdict == Verdict.ERROR:
        return f"Error: {clip(receipt.error or 'the run errored')}"
    if receipt.verdict == Verdict.FAIL:
        first = next((c for c in receipt.checks if c.status == CheckStatus.FAIL), None)
        return f"Fails {group_of(first.id)}: {short_reason(first)} ({first.id})" if first else "Fails"
    first = next(iter(checks_mod.not_passing(receipt.checks)), None)
    return f"Inconclusive: {short_reason(first)} ({first.id})" if first else "Inconclusive"


def detection_limit(receipt: Receipt) -> str | None:
    """'This run would have caught a scale error of 4.3 % or more ...': C.slope's threshold, the smallest error in
    the share of the update the engine applies that the run resolves; None for a receipt without C.slope."""
    check = next((c for c in receipt.checks if c.id == "C.slope"), None)
    if check is None or check.budget is None or check.status == CheckStatus.NOT_REACHED:
        return None
    return (f"Detection limit: this run would have caught a scale error of {100 * check.budget:.1f} % or more in the "
            "update the engine applies (`C.slope`'s threshold: k standard errors of the sampler's share of the "
            "trainer's change + the floor).")
