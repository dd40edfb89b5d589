"""The evidence table: one row per verified receipt, the mean |diff| of A, B and C and the result; the
header names the thresholds that decided when every receipt's checks had the same; a line below says
which receipts are signed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from lora_parity.evidence.receipt import BackendInfo, ComparisonStats, Receipt
from lora_parity.report.document import Para, Table, render_markdown
from lora_parity.report.facts import (
    HEADLINE,
    HEADLINE_CHECKS,
    NOT_REACHED,
    checks_by_id,
    has_start_adapter,
    outcome,
    signature_note,
    threshold,
)

TABLE_FORMATS = ("md", "rich")
TABLE_HEADER = ["Model / input", "A: zero-init diff", "B: diff before sync", "C: diff after sync", "Result"]


@dataclass(frozen=True)
class EvidenceRow:
    """One receipt as a row of the seed's evidence table (mean |diff| of each headline comparison)."""

    model_input: str
    a: str
    b: str
    c: str
    result: str

    def cells(self) -> list[str]:
        """The row's cells in TABLE_HEADER order."""
        return [self.model_input, self.a, self.b, self.c, self.result]


def model_input(receipt: Receipt) -> str:
    """'tiny-qwen3, held-out (hf → vllm, cpu)': model, a non-default probe set or source, a user's adapter
    (or the step update's warm start), an injected fault, then trainer → sampler and the device."""
    parts = [receipt.model.name]
    source = receipt.probes.source
    if source is not None and source.kind != "random":
        default = receipt.probes.set == "default"
        parts.append(f"{source.kind} probes" if default else f"{source.kind} {receipt.probes.set}")
    elif receipt.probes.set != "default":
        parts.append(receipt.probes.set)
    if receipt.start_adapter is not None:  # run --adapter: both sides started from the user's adapter
        parts.append("user adapter")
    elif "adapter_base" in receipt.scores:  # --update step: the seeded warm start, then one optimizer step
        parts.append("update step")
    if receipt.injected_fault:
        parts.append(f"injected {receipt.injected_fault}")
    return f"{', '.join(parts)} ({_side(receipt.trainer)} → {_side(receipt.sampler)}, {receipt.environment.device})"


def _side(info: BackendInfo) -> str:
    """'megatron TP2': the backend, with its tensor-parallel size when above 1."""
    tp = info.settings.get("tensor_parallel", info.settings.get("tensor_parallel_size", 1))
    return f"{info.backend} TP{tp}" if isinstance(tp, int) and tp > 1 else info.backend


def _mean_cell(cmp: ComparisonStats | None) -> str:
    return f"{cmp.mean_abs:.6f}" if cmp is not None else NOT_REACHED


def evidence_row(receipt: Receipt) -> EvidenceRow:
    """The evidence-table row of one receipt."""
    get = receipt.comparisons.get
    return EvidenceRow(model_input(receipt), _mean_cell(get(HEADLINE["A"][0])), _mean_cell(get(HEADLINE["B"][0])),
                       _mean_cell(get(HEADLINE["C"][0])), outcome(receipt))


def _dated(row: EvidenceRow, receipt: Receipt) -> EvidenceRow:
    when = receipt.created_at.replace("T", " ")
    label = row.model_input[:-1] + f", {when})" if row.model_input.endswith(")") else f"{row.model_input} ({when})"
    return EvidenceRow(label, row.a, row.b, row.c, row.result)


def table_rows(receipts: Sequence[Receipt]) -> list[list[str]]:
    """The rows' cells in order; rows whose Model / input would be the same name their run's date too,
    so that two runs of one setup can be told apart."""
    rows = [evidence_row(r) for r in receipts]
    seen = Counter(row.model_input for row in rows)
    return [(_dated(row, r) if seen[row.model_input] > 1 else row).cells()
            for row, r in zip(rows, receipts, strict=True)]


def _decided_mean(receipts: Sequence[Receipt], group: str) -> str:
    """' (≤ 0.0001)': the threshold that decided the group's mean check, when it is the same in every receipt."""
    decided = {threshold(c) for r in receipts for c in checks_by_id(r, HEADLINE_CHECKS[group][:1])}
    reached = all(checks_by_id(r, HEADLINE_CHECKS[group][:1]) for r in receipts)
    return f" ({decided.pop()})" if reached and len(decided) == 1 else ""


def _start_column(receipts: Sequence[Receipt]) -> str:
    """A's header: 'zero-init', 'start adapter' when every run started from a user's adapter, or both."""
    starts = {has_start_adapter(r) for r in receipts}
    if starts == {True}:
        return TABLE_HEADER[1].replace("zero-init", "start adapter")
    return TABLE_HEADER[1] if starts != {True, False} else "A: zero-init or start adapter diff"


def table_header(receipts: Sequence[Receipt]) -> list[str]:
    """The header; a threshold every receipt's mean checks were decided by is named in it, as in the seed."""
    return [TABLE_HEADER[0], _start_column(receipts) + _decided_mean(receipts, "A"),
            TABLE_HEADER[2] + _decided_mean(receipts, "B"), TABLE_HEADER[3] + _decided_mean(receipts, "C"),
            TABLE_HEADER[4]]


def signatures_line(paths: Sequence[str], signatures: Sequence[str | None]) -> str:
    """'Signatures: all 3 receipts unsigned.', or each kind with the receipts it applies to."""
    notes = [signature_note(s) for s in signatures]
    if len(notes) == 1:
        return f"Signature: {notes[0]}."
    if len(set(notes)) == 1:
        return f"Signatures: all {len(notes)} receipts {notes[0]}."
    kinds = dict.fromkeys(notes)
    return "Signatures: " + "; ".join(
        f"{kind}: {', '.join(p for p, n in zip(paths, notes, strict=True) if n == kind)}" for kind in kinds) + "."


def table_markdown(receipts: Sequence[Receipt], signatures: str | None = None) -> str:
    """The evidence table in markdown, one row per receipt in the order given; `signatures` (from
    `signatures_line`) below it."""
    return render_markdown([Table(table_header(receipts), table_rows(receipts)),
                            *([Para(signatures)] if signatures else [])])
