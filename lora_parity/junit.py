"""`run --junit PATH`: the receipt's checks as a JUnit XML report, for CI systems that show test results.

One test suite per run, one test case per check (`classname` lora-parity.MODEL, `name` the check id).
A failing or inconclusive check is a `<failure>` whose message is the check's reason (inconclusive
is not a pass); a check the run did not reach is `<skipped>`; a run that errored adds one test case,
`run`, with an `<error>` carrying the message. The file is written atomically.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from lora_parity.errors import ConfigError
from lora_parity.receipt import CheckStatus, Receipt


def _case(suite: ET.Element, classname: str, name: str, seconds: float = 0.0) -> ET.Element:
    return ET.SubElement(suite, "testcase", {"classname": classname, "name": name, "time": f"{seconds:.3f}"})


def junit_xml(receipt: Receipt, receipt_path: str) -> str:
    """The JUnit XML document of one receipt (see the module docstring)."""
    classname = f"lora-parity.{receipt.model.name}"
    suite = ET.Element("testsuite", {"name": f"lora-parity {receipt.model.name}: {receipt.trainer.backend} trainer "
                                             f"vs {receipt.sampler.backend} sampler",
                                     "timestamp": receipt.created_at.rstrip("Z"),
                                     "time": f"{receipt.timings.get('total', 0.0):.3f}"})
    props = ET.SubElement(suite, "properties")
    for key, value in (("receipt", receipt_path), ("verdict", receipt.verdict.value), ("digest", receipt.digest),
                       ("revision", receipt.revision.commit), ("injected_fault", receipt.injected_fault or "")):
        ET.SubElement(props, "property", {"name": key, "value": value})
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for check in receipt.checks:
        case = _case(suite, classname, check.id)
        counts["tests"] += 1
        if check.status in (CheckStatus.FAIL, CheckStatus.INCONCLUSIVE):
            counts["failures"] += 1
            ET.SubElement(case, "failure", {"message": f"{check.status.value}: {check.reason}",
                                            "type": check.status.value}).text = check.reason
        elif check.status == CheckStatus.NOT_REACHED:
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", {"message": check.reason})
    if receipt.error:
        counts["tests"] += 1
        counts["errors"] += 1
        case = _case(suite, classname, "run")
        ET.SubElement(case, "error", {"message": receipt.error, "type": "error"}).text = receipt.error
    for key, count in counts.items():
        suite.set(key, str(count))
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def write_junit(receipt: Receipt, receipt_path: str, path: Path) -> Path:
    """Write `junit_xml` to `path` atomically (a temporary file in its folder, then a rename); only a
    regular file is replaced."""
    from lora_parity.receipt_io import check_replaceable
    from lora_parity.report.files import write_atomic

    check_replaceable(path, "--junit")
    try:
        write_atomic(path, junit_xml(receipt, receipt_path))
    except OSError as e:
        raise ConfigError(f"--junit {path}: cannot write: {e.strerror or e}") from None
    return path


def check_target(path: Path) -> None:
    """Refuse, before a run, a `--junit` path that cannot be written: a folder, a missing folder, one
    that is not writable or full, or anything but a regular file in its place (a device stays one)."""
    from lora_parity.outpath import check_writable

    if path.is_dir():
        raise ConfigError(f"--junit {path}: is a folder; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"--junit {path}: folder {parent} does not exist")
    check_writable(path, force=True, option="--junit")
