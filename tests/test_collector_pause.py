"""The cycle collector paused while a CLI run imports its libraries and starts its backends (issue 47), and on
again, its heap frozen, once they have started or failed to; a caller of the Python API keeps its own setting."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_parity.run.runner import Backends, RunOptions, prepare
from lora_parity.util import lean
from tests.conftest import ROOT

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    yield
    lean._paused = False
    gc.unfreeze()
    gc.enable()


def test_pause_then_resume_freezes_the_heap_and_turns_the_collector_back_on() -> None:
    gc.unfreeze()
    lean.pause_collector()
    assert not gc.isenabled()
    lean.resume_collector()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    gc.unfreeze()
    lean.resume_collector()  # once only: a second resume freezes nothing
    assert gc.get_freeze_count() == 0


def test_a_collector_the_caller_turned_off_stays_off_and_unfrozen() -> None:
    gc.unfreeze()
    gc.disable()
    lean.pause_collector()  # nothing to pause
    lean.resume_collector()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_resume_without_a_pause_leaves_the_api_callers_heap_alone() -> None:
    gc.unfreeze()
    lean.resume_collector()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_backends_that_fail_to_start_still_turn_the_collector_back_on(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = prepare(RunOptions(trainer="fake", sampler="fake"))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the engine did not start")

    monkeypatch.setattr(plan.sampler_cls, "create", broken)
    lean.pause_collector()
    loaded = Backends(plan, lambda *a: None)
    loaded.open()
    assert loaded.error is not None and "did not start" in loaded.error
    assert gc.isenabled()


def test_the_cli_run_pauses_the_collector_until_its_backends_have_started(tmp_path: Path) -> None:
    # resume_collector is wrapped to note (in a file: the run's output goes to its log) whether the collector was
    # off when the backends had started, and whether it is on after
    said = tmp_path / "said.txt"
    probe = ("import gc, sys\nfrom lora_parity.util import lean\nreal = lean.resume_collector\n"
             "def noted():\n    states = [gc.isenabled()]\n    real()\n    states.append(gc.isenabled())\n"
             f"    open({str(said)!r}, 'a').write(repr(states))\n"
             "lean.resume_collector = noted\nfrom lora_parity.cli.app import main\n"
             "sys.argv = ['lora-parity', 'run', '--trainer', 'fake', '--sampler', 'fake', '--quiet', '--out', "
             f"{str(tmp_path / 'r.json')!r}]\nmain()")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert said.read_text() == "[False, True]"
