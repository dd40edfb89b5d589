"""Issue 15: `scripts/bench.py` reports each probe source's median wall time against --target, and
`--against` alternates every probe source between two checkouts (the processes are faked here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
WALLS = {"random": [40.0, 30.0, 35.0], "text": [50.0, 44.0, 47.0], "sampled": [20.0, 21.0, 22.0]}


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _receipt() -> dict[str, Any]:
    return {"model": {"name": "smollm2-135m"}, "sampler": {"backend": "vllm", "settings": {"scoring": "s"}},
            "trainer": {"settings": {}}, "environment": {"device": "cpu"}, "verdict": "pass",
            "probes": {"num_scored_positions": 192},
            "timings": {"sampler.start": 4.0, "score.zero": 1.0, "publish.v0": 0.1, "sync": 0.1, "total": 9.0,
                        "process.before_run": 1.5, "process.at_receipt": 15.0}}


def _fake_runs(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    calls: list[tuple[str, str | None]] = []
    count: dict[tuple[str, str | None], int] = {}

    def run(args: Any, probes: str, out: Path, code: str | None = None,
            sampler: str | None = None) -> tuple[float, dict[str, Any]]:
        calls.append((probes, code))
        i = count[probes, code] = count.get((probes, code), -1) + 1
        return WALLS[probes][i] * (2 if code else 1), _receipt()

    monkeypatch.setattr(bench, "_run", run)
    return calls


def test_each_probe_source_median_is_reported_against_the_target(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    calls = _fake_runs(bench, monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", "smollm2-135m", "--probes", "random,text,sampled",
                                      "--target", "45"])
    assert bench.main() == 1  # text's median 47 s is over 45 s
    out = capsys.readouterr().out
    assert [p for p, _ in calls] == ["random", "text", "sampled"] * 3  # alternating
    assert "smollm2-135m probes random: median 35.0 s of 3 fresh processes (target <= 45 s: met)" in out
    assert "smollm2-135m probes text: median 47.0 s of 3 fresh processes (target <= 45 s: MISSED)" in out
    assert "smollm2-135m probes sampled: median 21.0 s of 3 fresh processes (target <= 45 s: met)" in out
    # sampled's median wall 21 s, less the run's own 9 s and the engine's start 4 s (at 9bce4a6 the start was counted)
    assert "of which outside the run  median   8.000 s" in out
    # ... split by the process's own clock: 1.5 s before the run, 21 - 15 s after the receipt was sealed
    assert "before the run          median   1.500 s" in out and "after the receipt       median   6.000 s" in out
    assert "process.before_run" not in out  # not a phase


def test_within_the_target_exits_0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    _fake_runs(bench, monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--probes", "random,sampled", "--target", "45"])
    assert bench.main() == 0
    assert "MISSED" not in capsys.readouterr().out


def test_against_alternates_every_probe_source(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    calls = _fake_runs(bench, monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--probes", "random,text", "--against", "OLD", "--runs", "2"])
    assert bench.main() == 0
    assert calls == [("random", None), ("random", "OLD"), ("text", None), ("text", "OLD")] * 2
    out = capsys.readouterr().out
    assert "run (OLD), probes random: median 70.00 s of 2" in out
    assert "probes random: this / OLD = 0.50x" in out and "probes text: this / OLD = 0.50x" in out


def test_against_runs_the_other_checkouts_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m` puts the working directory ahead of PYTHONPATH: the other checkout's run starts there."""
    import subprocess

    bench = _bench()
    other = tmp_path / "other"
    (other / "lora_parity").mkdir(parents=True)
    (other / "lora_parity" / "__init__.py").write_text("")
    (other / "lora_parity" / "__main__.py").write_text("print('other checkout')\n")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # a checkout of this code, as `make bench` runs
    res = subprocess.run([sys.executable, "-m", "lora_parity"], capture_output=True, text=True,
                         env=bench._env(str(other)), cwd=bench._cwd(str(other)))
    assert res.stdout.strip() == "other checkout"


def test_refusals_are_timed_and_each_must_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    exits = {"refused": 2, "ran": 0}
    monkeypatch.setattr(bench, "REFUSALS", {"refused": ["refused"], "ran": ["ran"]})
    monkeypatch.setattr(bench, "_timed", lambda cmd, cwd=None: (0.5, exits[cmd[3]]))
    monkeypatch.setattr(sys, "argv", ["bench.py", "--refusals", "--runs", "2"])
    assert bench.main() == 1  # "ran" exits 0: not a refusal
    assert "refusal refused: median 0.50 s of 2 (exit [2]; target <= 1 s)" in capsys.readouterr().out
    monkeypatch.setattr(bench, "REFUSALS", {"refused": ["refused"]})
    assert bench.main() == 0
    assert "slowest median 0.50 s (target <= 1 s: met)" in capsys.readouterr().out


def test_floor_gives_both_ratios_from_one_invocation(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    monkeypatch.setattr(bench, "_run", lambda args, probes, out, code=None, sampler=None: (12.0, _receipt()))
    monkeypatch.setattr(bench, "_timed", lambda cmd, cwd=None: (8.0, 0))
    monkeypatch.setattr(bench, "_selftest", lambda args, tmp, code, i: 18.0)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--floor", "--runs", "2"])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "run / import floor: 1.50x (target <= 1.6x); selftest / run: 1.50x (target <= 2x)" in out


def test_keep_copies_the_receipt_of_every_run_that_did_not_pass(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """A bench run whose verdict is not pass is evidence (the H200's 10x runs failed and their receipts were lost)."""
    import argparse
    import json
    import subprocess

    bench = _bench()
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        verdict = "fail" if "default-x10" in cmd else "pass"
        Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({**_receipt(), "verdict": verdict}))
        return subprocess.CompletedProcess(cmd, 1 if verdict == "fail" else 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = argparse.Namespace(sync="new-id", model=None, per_target=True, keep=str(tmp_path / "kept"))
    for probes in ("default", "default-x10"):
        assert bench._run(args, probes, tmp_path / f"{probes}.json") is not None
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["default-x10-default-x10.json"]
    assert all("--per-target" in cmd for cmd in seen)
