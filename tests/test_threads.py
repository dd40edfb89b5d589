"""Issue 15: on a busy machine OpenMP's wait policy is set to PASSIVE before a backend's libraries
load (a spinning OpenMP team on a shared 2-core machine made one scoring pass 10-60x slower); on an
idle one OpenMP's default stays (spinning is faster there)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lora_parity import backends
from lora_parity.util import threads

pytestmark = pytest.mark.unit


@pytest.fixture
def no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)


@pytest.mark.usefixtures("no_torch")
def test_passive_on_a_busy_machine() -> None:
    assert threads.set_wait_policy(lambda: 1.0) == "PASSIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.usefixtures("no_torch")
@pytest.mark.parametrize("others", [0.0, 0.4, None])
def test_openmp_default_on_an_idle_machine_or_where_unknown(others: float | None) -> None:
    assert threads.set_wait_policy(lambda: others) is None
    assert "OMP_WAIT_POLICY" not in os.environ


@pytest.mark.usefixtures("no_torch")
def test_the_users_value_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert threads.set_wait_policy(lambda: 5.0) == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_not_set_once_torch_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert threads.set_wait_policy(lambda: 5.0) is None
    assert "OMP_WAIT_POLICY" not in os.environ  # too late to apply: not pretended


def test_other_runnable_excludes_the_reader_and_averages() -> None:
    counts = iter([1, 2, 3, 1])
    assert threads.other_runnable(lambda: next(counts), samples=4, interval=0.0) == pytest.approx(0.75)
    assert threads.other_runnable(lambda: None, samples=3, interval=0.0) is None


def test_other_runnable_reads_this_machine() -> None:
    others = threads.other_runnable(samples=2, interval=0.0)
    assert others is None or others >= 0.0


@pytest.mark.parametrize(("others", "policy"), [(2.0, "PASSIVE"), (0.0, "None")])
def test_resolving_a_backend_chooses_it_before_torch_loads(others: float, policy: str) -> None:
    code = ("import os, sys; from lora_parity import backends; from lora_parity.util import threads; "
            f"threads.other_runnable = lambda: {others}; "
            "assert 'OMP_WAIT_POLICY' not in os.environ and 'torch' not in sys.modules; "
            "backends.resolve('trainer', 'fake'); print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == policy


@pytest.mark.usefixtures("no_torch")
def test_an_unknown_backend_is_refused_before_anything_is_set() -> None:
    with pytest.raises(ValueError, match="unknown trainer backend"):
        backends.resolve("trainer", "nope")
    assert "OMP_WAIT_POLICY" not in os.environ
