"""`run --junit PATH`: the receipt's checks as a JUnit XML report, for CI systems that show test results.

One test suite per run, one test case per check (`classname` lora-parity.MODEL, `name` the check id).
Each case's properties are what it observed and the threshold that decided it (the check's own `op`
and `budget`, derived or fixed) and its verdict group (sync or numerics). A failing or inconclusive
check is a `<failure>` whose message is the check's reason (inconclusive is not a pass); a check the
run did not reach is `<skipped>`; a run that errored adds one test case, `run`, with an `<error>`
carrying the message. The suite's properties hold the verdict, the sync and numerics verdicts and the
signature. Every string passes `escape.xml` (a receipt's control characters would make the XML
invalid). The file is written atomically.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from lora_parity.evidence.receipt import Check, CheckStatus, Receipt
from lora_parity.report.document import fmt_num
from lora_parity.report.facts import signature_note, threshold
from lora_parity.util.errors import ConfigError
from lora_parity.util.escape import xml
from lora_parity.verdict import check_rules


def _element(parent: ET.Element, tag: str, attrs: dict[str, str], text: str | None = None) -> ET.Element:
    """A child element whose attribute values and text have passed `escape.xml`."""
    element = ET.SubElement(parent, tag, {k: xml(v) for k, v in attrs.items()})
    if text is not None:
        element.text = xml(text)
    return element


def _properties(parent: ET.Element, values: dict[str, str]) -> None:
    props = _element(parent, "properties", {})
    for key, value in values.items():
        _element(props, "property", {"name": key, "value": value})


def _check_case(suite: ET.Element, classname: str, check: Check) -> ET.Element:
    case = _element(suite, "testcase", {"classname": classname, "name": check.id, "time": "0.000"})
    _properties(case, {"observed": fmt_num(check.observed), "threshold": threshold(check),
                       "group": check_rules.group_of(check.id)})
    return case


def junit_xml(receipt: Receipt, receipt_path: str, signature: str | None = None) -> str:
    """The JUnit XML document of one receipt (see the module docstring); `signature` is `verify`'s
    signature status of the receipt (None: unsigned)."""
    classname = f"lora-parity.{receipt.model.name}"
    suite = _element(ET.Element("root"), "testsuite", {
        "name": f"lora-parity {receipt.model.name}: {receipt.trainer.backend} trainer vs {receipt.sampler.backend} "
                "sampler",
        "timestamp": receipt.created_at.rstrip("Z"), "time": f"{receipt.timings.get('total', 0.0):.3f}"})
    verdicts = receipt.verdicts
    _properties(suite, {
        "receipt": receipt_path, "verdict": receipt.verdict.value,
        **({"verdict.sync": verdicts.sync.verdict.value, "verdict.numerics": verdicts.numerics.verdict.value}
           if verdicts else {}),
        "signature": signature_note(signature), "digest": receipt.digest, "revision": receipt.revision.commit,
        "injected_fault": receipt.injected_fault or ""})
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for check in receipt.checks:
        case = _check_case(suite, classname, check)
        counts["tests"] += 1
        if check.status in (CheckStatus.FAIL, CheckStatus.INCONCLUSIVE):
            counts["failures"] += 1
            _element(case, "failure", {"message": f"{check.status.value} (threshold {threshold(check)}): "
                                                  f"{check.reason}", "type": check.status.value}, check.reason)
        elif check.status == CheckStatus.NOT_REACHED:
            counts["skipped"] += 1
            _element(case, "skipped", {"message": check.reason})
    if receipt.error:
        counts["tests"] += 1
        counts["errors"] += 1
        case = _element(suite, "testcase", {"classname": classname, "name": "run", "time": "0.000"})
        _element(case, "error", {"message": receipt.error, "type": "error"}, receipt.error)
    for key, count in counts.items():
        suite.set(key, str(count))
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def write_junit(receipt: Receipt, receipt_path: str, path: Path, signature: str | None = None) -> Path:
    """Write `junit_xml` to `path` atomically (a temporary file in its folder, then a rename); only a
    regular file is replaced."""
    from lora_parity.evidence.receipt_io import check_replaceable
    from lora_parity.report.files import write_atomic

    check_replaceable(path, "--junit")
    try:
        write_atomic(path, junit_xml(receipt, receipt_path, signature))
    except OSError as e:
        raise ConfigError(f"--junit {path}: cannot write: {e.strerror or e}") from None
    return path


def check_target(path: Path) -> None:
    """Refuse, before a run, a `--junit` path that cannot be written: a folder, a missing folder, one
    that is not writable or full, or anything but a regular file in its place (a device stays one)."""
    from lora_parity.evidence.outpath import check_writable

    if path.is_dir():
        raise ConfigError(f"--junit {path}: is a folder; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"--junit {path}: folder {parent} does not exist")
    check_writable(path, force=True, option="--junit")
