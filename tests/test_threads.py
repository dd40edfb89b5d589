"""Issue 15: OpenMP's wait policy is set to PASSIVE before a backend's libraries load (a spinning
OpenMP team on a shared 2-core machine made one scoring pass 10-60x slower)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lora_parity import backends, threads

pytestmark = pytest.mark.unit


def test_passive_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert threads.set_wait_policy() == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert threads.set_wait_policy() == "ACTIVE"  # the user's value wins
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_not_set_once_torch_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert threads.set_wait_policy() is None
    assert "OMP_WAIT_POLICY" not in os.environ  # too late to apply: not pretended


def test_resolving_a_backend_sets_it_before_torch_loads() -> None:
    code = ("import os, sys; from lora_parity import backends; "
            "assert 'OMP_WAIT_POLICY' not in os.environ and 'torch' not in sys.modules; "
            "backends.resolve('trainer', 'fake'); print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "PASSIVE"


def test_an_unknown_backend_is_refused_before_anything_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(ValueError, match="unknown trainer backend"):
        backends.resolve("trainer", "nope")
    assert "OMP_WAIT_POLICY" not in os.environ
