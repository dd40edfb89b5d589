"""A backend registered from outside the package runs the whole sequence; what it declares decides
what the run may do (traits, optional protocols), checked before anything loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lora_parity import backends
from lora_parity.backends.base import AdapterHandle, SamplerBackend, Scores, Sequences
from lora_parity.backends.fake import FakeSampler, FakeTrainer
from lora_parity.evidence.receipt import BackendInfo, CheckStatus, Verdict
from lora_parity.models.config import ModelConfig
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ConfigError
from lora_parity.verdict.verify import verify

pytestmark = pytest.mark.unit


class EchoSampler(FakeSampler):
    """The fake sampler under another name: what a new sampler backend looks like to the sequence."""

    def info(self) -> BackendInfo:
        return BackendInfo(backend="echo", versions={}, settings={"device": "cpu"})


class ShiftedSampler(EchoSampler):
    """A new sampler with the classic off-by-one: its entry t is the rule's entry t + 1."""

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        return [seq[1:] + seq[-1:] for seq in super().score(sequences, adapter)]


class AdapterOnlySampler(SamplerBackend):
    """A sampler that serves adapters but cannot reload its base weights (no `BaseReloadingSampler`)."""

    def __init__(self, cfg: ModelConfig, model_dir: Path | None, timings: dict[str, float], lora: bool = True) -> None:
        self.inner = FakeSampler(cfg, model_dir, timings)

    def score(self, sequences: Sequences, adapter: AdapterHandle | None) -> Scores:
        return self.inner.score(sequences, adapter)

    def publish(self, directory: Path, name: str, adapter_id: int, inplace: bool = False) -> AdapterHandle:
        return self.inner.publish(directory, name, adapter_id, inplace)

    def retire(self, handle: AdapterHandle) -> None:
        self.inner.retire(handle)

    def info(self) -> BackendInfo:
        return BackendInfo(backend="adapter-only", versions={}, settings={})

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "TRAINERS", dict(backends.TRAINERS))
    monkeypatch.setattr(backends, "SAMPLERS", dict(backends.SAMPLERS))


def test_a_registered_sampler_runs_the_whole_sequence(tmp_path: Path) -> None:
    backends.register("sampler", "echo", EchoSampler)
    out = tmp_path / "echo.json"
    receipt = execute(RunOptions(trainer="fake", sampler="echo", out=out)).receipt
    assert receipt.verdict == Verdict.PASS, [c.id for c in receipt.checks if c.status != CheckStatus.PASS]
    assert receipt.sampler.backend == "echo"
    assert [p.name for p in receipt.phases][:3] == ["base", "publish_zero", "zero"]
    assert any(p.name.startswith("target.") for p in receipt.phases)
    assert verify(out).verdict == Verdict.PASS


@pytest.mark.parametrize("mode", ["new-id", "inplace", "merged", "memory"])
def test_a_registered_sampler_that_breaks_the_alignment_rule_fails_a(mode: str, tmp_path: Path) -> None:
    backends.register("sampler", "shifted", "tests.test_extending:ShiftedSampler")
    receipt = execute(RunOptions(trainer="fake", sampler="shifted", sync=mode, out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.FAIL
    assert {c.id: c.status for c in receipt.checks}["A.parity.mean"] == CheckStatus.FAIL


def test_the_merged_modes_need_what_they_require_before_anything_loads(tmp_path: Path) -> None:
    backends.register("sampler", "adapter-only", AdapterOnlySampler)
    ok = execute(RunOptions(trainer="fake", sampler="adapter-only", out=tmp_path / "ok.json", per_target=False))
    assert ok.receipt.verdict == Verdict.PASS
    for mode in ("merged", "memory"):
        with pytest.raises(ConfigError, match=f"--sync {mode} needs a sampler that reloads base weights"):
            execute(RunOptions(trainer="fake", sampler="adapter-only", sync=mode, out=tmp_path / mode))
        assert not (tmp_path / mode).exists()


def test_traits_decide_what_a_run_may_ask_of_a_backend(tmp_path: Path) -> None:
    class NoCheckpointTrainer(FakeTrainer):
        traits = replace(FakeTrainer.traits, supports_tp=False)

    backends.register("trainer", "plain", NoCheckpointTrainer)
    with pytest.raises(ConfigError, match="--tp applies to the megatron trainer only"):
        execute(RunOptions(trainer="plain", sampler="fake", tp=2, out=tmp_path / "r.json"))
    with pytest.raises(ConfigError, match="--reference fp32 loads the checkpoint with HF; these backends use none"):
        execute(RunOptions(trainer="plain", sampler="fake", reference="fp32", out=tmp_path / "r.json"))
    with pytest.raises(ConfigError, match="apply to the tinker backends only"):
        execute(RunOptions(trainer="plain", sampler="fake", tinker_url="http://127.0.0.1:1", out=tmp_path / "r.json"))


def test_only_backend_classes_register() -> None:
    backends.register("trainer", "not-a-backend", object)
    with pytest.raises(ConfigError, match="is not a TrainerBackend subclass"):
        backends.resolve("trainer", "not-a-backend")
