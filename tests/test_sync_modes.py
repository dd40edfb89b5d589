"""Every way weights reach the sampler: new-id, inplace, merged, memory; each with its silent failure."""

from pathlib import Path

import pytest

from lora_parity.evidence.receipt import CheckStatus, Verdict
from lora_parity.run.faults import FAULTS, faults_for
from lora_parity.run.runner import RunOptions, execute
from lora_parity.run.selftest import selftest
from lora_parity.verdict.verify import verify

OWN_FAULT = {"new-id": "reuse-adapter-id", "inplace": "no-reload-flag", "merged": "stale-path",
             "memory": "stale-tensors"}


@pytest.mark.unit
@pytest.mark.parametrize("mode", list(OWN_FAULT))
def test_every_mode_passes_and_catches_every_fault_on_fakes(mode: str, tmp_path: Path) -> None:
    result = selftest(RunOptions(trainer="fake", sampler="fake", sync=mode), tmp_path)
    assert result.ok, [r for r in result.rows if not r.caught]
    assert OWN_FAULT[mode] in [r.fault for r in result.rows]
    receipt = verify(Path(result.rows[0].receipt)).receipt
    assert receipt.sync_mode == mode and receipt.timings["sync"] > 0


@pytest.mark.unit
def test_each_mode_has_exactly_one_own_silent_failure() -> None:
    from lora_parity.run.loop import LOOP_FAULTS

    of_loop = {f.name for f in LOOP_FAULTS}  # a setting of the user's loop brings its own (bucket_mb: bucket-lost)
    for mode, fault in OWN_FAULT.items():
        own = [f for f in faults_for(mode) if FAULTS[f.partition("=")[0]].modes == (mode,) and f not in of_loop]
        assert own == [fault]


@pytest.mark.unit
def test_merged_modes_record_no_adapter_ids(tmp_path: Path) -> None:
    receipt = execute(RunOptions(trainer="fake", sampler="fake", sync="merged", out=tmp_path / "r.json")).receipt
    assert [a.adapter_id for a in receipt.adapters] == [0] * len(receipt.adapters)
    assert {a.mode for a in receipt.adapters} == {"merged"}


@pytest.mark.unit
def test_fault_of_another_mode_is_refused(tmp_path: Path) -> None:
    from lora_parity.util.errors import ConfigError

    with pytest.raises(ConfigError, match="applies to sync modes merged"):
        execute(RunOptions(trainer="fake", sampler="fake", sync="new-id", inject="stale-path", out=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


@pytest.mark.cpu_e2e
@pytest.mark.parametrize("mode", ["inplace", "merged", "memory"])
def test_mode_passes_and_its_silent_failure_is_caught_with_real_backends(mode: str, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    result = selftest(RunOptions(sync=mode), tmp_path, faults=[OWN_FAULT[mode]])
    clean, fault = result.rows
    assert clean.caught, clean
    assert fault.fault == OWN_FAULT[mode] and fault.caught, fault
    receipt = verify(Path(clean.receipt)).receipt
    assert receipt.verdict == Verdict.PASS and receipt.sync_mode == mode
    # Per-target coverage runs in every mode: each target kind reached the sampler.
    assert any(c.id == "T.down_proj.moved" for c in receipt.checks)
    # The merged modes end with the engine's own base weights reloaded and scored: its first base scores again.
    restored = [c for c in receipt.checks if c.id == "D.base_restored"]
    assert [(c.status, bool(c.elements)) for c in restored] == ([] if mode == "inplace" else [(CheckStatus.PASS, True)])
