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


def test_per_target_coverage_counts_the_target_phases_only(bench: ModuleType) -> None:
    # issue 26's share: the target.<name> phases (search, scoring and sync inside them), not their
    # score.target.* parts again, nor the run's other phases
    timings = {"score.zero": 1.0, "calibrate": 2.0, "target.q_proj": 3.0, "score.target.q_proj.sampler": 1.5,
               "publish.v3": 0.2, "target.v_proj": 0.5, "total": 9.0}
    assert bench.per_target_seconds(timings) == pytest.approx(3.5)
    assert bench.per_target_seconds({"score.zero": 1.0, "total": 2.0}) == 0.0


def test_the_backends_start_s_untimed_part_is_what_its_timed_parts_leave(bench: ModuleType) -> None:
    # issue 47: the seconds of `backends.open` that no other timer holds
    in_process = {"backends.import": 3.0, "backends.open": 6.0, "model.materialize": 0.1, "model.digest": 0.4,
                  "sampler.import": 2.0, "sampler.start": 2.5, "trainer.load": 0.5}
    assert bench.untimed_in_open(in_process) == pytest.approx(0.5)
    served = {"backends.open": 4.0, "sampler.start": 12.0, "sampler.start_wait": 3.0, "trainer.load": 0.5}
    assert bench.untimed_in_open(served) == pytest.approx(0.5)
    assert bench.untimed_in_open({"sampler.start": 2.0}) is None  # a receipt from before the timer
