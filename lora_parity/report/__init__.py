"""report: receipts people read: the PR report, the evidence table, the JSON Schema and the receipt diff.
Rendering a verified receipt into text, plain data or a folder with plots (`files`); no backend, no run.
May import util/, evidence/ and verdict/ only.

Pure rendering: a verified `Receipt` in, text or plain data out; no I/O. The CLI loads (and
verifies) receipts, writes plots (`lora_parity.report.plots`, imported on demand: it needs
matplotlib) and prints what these functions return.

- `document`: the block model (headings, tables, ...) and its markdown and plain-text renderers.
- `facts`: what every rendering reads off a receipt (headline comparisons, worst positions, outcomes).
- `pr`: the PR report (markdown, text, JSON, HTML); `files`: the report written to a folder with
  its plots (`report --out`); `table`: the evidence table; `diff`: two receipts
  side by side; `schema`: the receipt's JSON Schema.
"""

from lora_parity.report.diff import diff_blocks, diff_markdown, diff_receipts
from lora_parity.report.document import (
    Block,
    Bullets,
    Details,
    Heading,
    Image,
    Para,
    Table,
    check_format,
    code,
    fmt_num,
    fmt_signed,
    render_html,
    render_markdown,
    render_text,
)
from lora_parity.report.facts import (
    CHECK_TITLES,
    HEADLINE,
    NUM_WORST,
    Position,
    group_status,
    outcome,
    position_diffs,
    short_reason,
    worst_diffs,
)
from lora_parity.report.pr import REPORT_FORMATS, render_report, report_blocks, report_data, report_markdown
from lora_parity.report.schema import schema_json
from lora_parity.report.table import (
    TABLE_FORMATS,
    TABLE_HEADER,
    EvidenceRow,
    evidence_row,
    model_input,
    signatures_line,
    table_header,
    table_markdown,
    table_rows,
)

__all__ = [
    "CHECK_TITLES",
    "HEADLINE",
    "NUM_WORST",
    "REPORT_FORMATS",
    "TABLE_FORMATS",
    "TABLE_HEADER",
    "Block",
    "Bullets",
    "Details",
    "EvidenceRow",
    "Heading",
    "Image",
    "Para",
    "Position",
    "Table",
    "check_format",
    "code",
    "diff_blocks",
    "diff_markdown",
    "diff_receipts",
    "evidence_row",
    "fmt_num",
    "fmt_signed",
    "group_status",
    "model_input",
    "outcome",
    "position_diffs",
    "render_html",
    "render_markdown",
    "render_report",
    "render_text",
    "report_blocks",
    "report_data",
    "report_markdown",
    "schema_json",
    "short_reason",
    "signatures_line",
    "table_header",
    "table_markdown",
    "table_rows",
    "worst_diffs",
]
