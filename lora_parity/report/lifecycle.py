"""The report's lifecycle section: the engine as deployed, what this run covered and what it did not
(`verdict.lifecycle`). A receipt made before the table was recorded is derived the same way."""

from __future__ import annotations

from lora_parity.evidence.receipt import LifecycleRow, Receipt
from lora_parity.report.document import Block, Heading, Para, Table
from lora_parity.verdict import lifecycle


def rows(receipt: Receipt) -> list[LifecycleRow]:
    """The receipt's recorded table, or the one its phases and sampler settings give."""
    return list(receipt.lifecycle) if receipt.lifecycle is not None else lifecycle.of_receipt(receipt)


def blocks(receipt: Receipt) -> list[Block]:
    """A heading, one line naming what was not covered, and the table."""
    table = rows(receipt)
    missing = [r.condition for r in lifecycle.not_covered(table)]
    line = (f"**Not covered** ({len(missing)} of {len(table)}; not a pass, nothing here tested them): "
            + ", ".join(missing) + ".") if missing else "Every condition in the table was covered."
    return [Heading("The engine as deployed"), Para(line),
            Table(["condition", "status", "what ran"], [[r.condition, r.status, r.detail] for r in table])]
