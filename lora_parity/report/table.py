"""The evidence table: one row per verified receipt, the mean |diff| of A, B and C and the result."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from lora_parity.receipt import BackendInfo, ComparisonStats, Receipt
from lora_parity.report.document import Table, fmt_budget, render_markdown
from lora_parity.report.facts import HEADLINE, NOT_REACHED, outcome

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
    """'tiny-qwen3, held-out (hf → vllm, cpu)': model, a non-default probe set or source, a user's adapter,
    an injected fault, then trainer → sampler and the device."""
    parts = [receipt.model.name]
    source = receipt.probes.source
    if source is not None and source.kind != "random":
        default = receipt.probes.set == "default"
        parts.append(f"{source.kind} probes" if default else f"{source.kind} {receipt.probes.set}")
    elif receipt.probes.set != "default":
        parts.append(receipt.probes.set)
    if "adapter_base" in receipt.scores:  # run --adapter: both sides started from the user's adapter
        parts.append("user adapter")
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


def table_header(receipts: Sequence[Receipt]) -> list[str]:
    """The header; when every receipt has the same budgets they are named in it, as in the seed."""
    budgets = {r.budgets for r in receipts}
    if len(budgets) != 1:
        return list(TABLE_HEADER)
    (b,) = budgets
    return [TABLE_HEADER[0], f"{TABLE_HEADER[1]} (≤ {fmt_budget(b.mean)})",
            f"{TABLE_HEADER[2]} (≥ {fmt_budget(b.min_stimulus)})", f"{TABLE_HEADER[3]} (≤ {fmt_budget(b.mean)})",
            TABLE_HEADER[4]]


def table_markdown(receipts: Sequence[Receipt]) -> str:
    """The evidence table in markdown, one row per receipt in the order given."""
    return render_markdown([Table(table_header(receipts), table_rows(receipts))])
