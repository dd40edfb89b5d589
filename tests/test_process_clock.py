"""The process's own clock (`util.process_clock`): a receipt records the process's age as its run starts and as the
receipt is sealed, so `make bench` can tell the time before the run and after it (issue 47)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lora_parity.util import process_clock

pytestmark = pytest.mark.unit


def test_the_age_counts_from_the_process_start() -> None:
    code = "import time; time.sleep(0.5); from lora_parity.util import process_clock; print(process_clock.age())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= age < 30
    first = process_clock.age()
    assert first is not None and process_clock.stamp("k") and process_clock.stamp("k")["k"] >= first


def test_without_proc_there_is_no_age_and_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(self: Path, *args: object, **kwargs: object) -> str:
        raise OSError("no /proc")

    monkeypatch.setattr(Path, "read_text", unreadable)
    assert process_clock.age() is None and process_clock.stamp("k") == {}


def test_a_run_records_its_age_before_the_run_and_at_the_receipt(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "lora_parity", "run", "--trainer", "fake", "--sampler", "fake", "--out",
                    str(out)], capture_output=True, text=True, check=True)
    timings = json.loads(out.read_text())["timings"]
    assert 0 < timings["process.before_run"] < timings["process.at_receipt"]
    assert timings["process.at_receipt"] - timings["process.before_run"] >= timings["total"] - 0.02
