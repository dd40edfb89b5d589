"""`lora-parity report --out DIR`: the report as a file with its plots beside it.

The markdown links each plot by its bare file name, relative to the report itself, so the folder
renders wherever it is committed or attached (a PR, a wiki); the HTML page inlines its plots as
data: URIs and stands alone. Files are written atomically (a temporary file, then a rename).
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

from lora_parity.evidence.receipt import Receipt
from lora_parity.report.pr import render_report
from lora_parity.util import safe_write
from lora_parity.util.errors import ConfigError

REPORT_FILES = {"md": "report.md", "text": "report.txt", "json": "report.json", "html": "report.html"}
"""Format → the report's file name in the `--out` folder."""


def data_uri(png: Path) -> str:
    """A PNG file as a data: URI."""
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def inline_plots(receipt: Receipt) -> dict[str, str]:
    """The plots drawn in a temporary folder, as data: URIs (comparison → URI)."""
    from lora_parity.report.plots import write_plots

    with tempfile.TemporaryDirectory(prefix="lora-parity-plots-") as tmp:
        return {name: data_uri(p) for name, p in write_plots(receipt, Path(tmp)).items()}


def write_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` (`util.safe_write`: a regular file only, never through a link, an
    unpredictable temporary file and a rename)."""
    safe_write.write_atomic(path, text)


def write_report(receipt: Receipt, receipt_label: str, out_dir: Path, fmt: str, signature: str | None = None) -> Path:
    """Write the report in `fmt` to `out_dir/report.<ext>` with its PNG plots beside it (inlined for
    html), and return the report's path. `receipt_label` is how the report names the receipt;
    `signature` is `verify`'s signature status."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out_dir}: cannot create the folder: {e.strerror or e}") from None
    target = out_dir / REPORT_FILES[fmt]
    safe_write.check_replaceable(target)  # before any plot is drawn: a device or a link there is refused
    if fmt == "html":
        links = inline_plots(receipt)
    else:
        from lora_parity.report.plots import write_plots

        try:
            links = {name: p.name for name, p in write_plots(receipt, out_dir).items()}
        except OSError as e:
            raise ConfigError(f"--out {out_dir}: cannot write the plots: {e.strerror or e}") from None
    try:
        write_atomic(target, render_report(receipt, receipt_label, fmt, links, signature))
    except OSError as e:
        raise ConfigError(f"--out {out_dir}: cannot write {target.name}: {e.strerror or e}") from None
    return target
