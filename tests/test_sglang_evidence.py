"""The committed H200 SGLang selftest summaries are what scripts/summarize-sglang-selftests.py prints over their
committed tarballs (the evidence was not edited by hand), and every selftest in them printed "ok"."""

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.unit
SUMMARY = ROOT / "benchmarks" / "gpu-sglang-selftest-2a2ab4c.txt"


def _summarize(tmp_path: Path, tarball: Path) -> str:
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp_path, filter="data")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "summarize-sglang-selftests.py"), str(tmp_path)],
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)}, check=True)
    return done.stdout


def test_summary_is_the_tarballs(tmp_path: Path) -> None:
    printed = _summarize(tmp_path, SUMMARY.with_suffix(".tar.xz"))
    committed = "".join(line + "\n" for line in SUMMARY.read_text().splitlines() if not line.startswith("#"))
    assert printed == committed


def test_every_selftest_ok_and_no_false_alarm() -> None:
    heads = [line for line in SUMMARY.read_text().splitlines() if line.startswith("sglang-")]
    assert len(heads) == 4
    for head in heads:
        assert "ok True" in head and "false alarms 0/" in head and "16/16 faults caught in every seed" in head
    # unload-before-score does not apply to SGLang (it reloads an unloaded name from its path)
    rows = [line.split()[0] for line in SUMMARY.read_text().splitlines() if line.startswith("  ") and "/" in line]
    assert "skip-sync" in rows and "unload-before-score" not in rows
