"""Golden evidence: every receipt committed in receipts/ still verifies."""

from pathlib import Path

import pytest

from lora_parity.receipt import Verdict
from lora_parity.verify import verify

from .conftest import ROOT

pytestmark = pytest.mark.unit
RECEIPTS = sorted((ROOT / "receipts").glob("*.json"))


def test_there_is_committed_evidence() -> None:
    assert any(p.name.startswith("tiny-qwen3__hf__vllm__") for p in RECEIPTS)


@pytest.mark.parametrize("path", RECEIPTS, ids=lambda p: p.name)
def test_committed_receipt_verifies(path: Path) -> None:
    verified = verify(path)
    # Receipts of deliberately faulty runs say so in their name; every other one passes.
    if "fault-" in path.name:
        assert verified.verdict != Verdict.PASS
    else:
        assert verified.verdict == Verdict.PASS
