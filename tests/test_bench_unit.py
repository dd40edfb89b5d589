"""scripts/bench.py's pure parts: what the runs alternate between, and the engine time a run paid."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench", Path(__file__).parents[1] / "scripts" / "bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_samplers_alternate_on_the_first_probe_set(bench: ModuleType) -> None:
    args = argparse.Namespace(probes="default,default-x10", sampler="vllm,vllm-server")
    assert bench._variants(args) == {"vllm": ("default", "vllm"), "vllm-server": ("default", "vllm-server")}
    args = argparse.Namespace(probes="default,default-x10", sampler=None)
    assert bench._variants(args) == {"default": ("default", None), "default-x10": ("default-x10", None)}


def test_a_served_sampler_costs_the_run_its_wait_not_its_whole_start(bench: ModuleType) -> None:
    in_process = {"backends.import": 3.0, "sampler.import": 2.0, "sampler.start": 2.0, "trainer.load": 0.5}
    assert bench._engine_seconds(in_process) == pytest.approx(7.5)
    served = {"backends.import": 3.0, "sampler.start": 12.0, "sampler.start_wait": 11.5, "trainer.load": 0.5}
    assert bench._engine_seconds(served) == pytest.approx(15.0)
