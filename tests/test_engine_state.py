"""The engine after the sync (issue 51): its base route gives its first base scores again after the sync and after
per-target coverage, and the version the sync replaced, scored while the new one is live, its stale scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lora_parity.backends import fake
from lora_parity.evidence.receipt import CheckStatus, Receipt, Verdict
from lora_parity.models import config
from lora_parity.run.faults import faults_for
from lora_parity.run.options import RunOptions
from lora_parity.run.runner import execute
from lora_parity.verdict import findings
from lora_parity.verdict.verify import verify

from .conftest import run_fakes

FAKE: dict[str, Any] = {"trainer": "fake", "sampler": "fake"}


def run(tmp_path: Path, **kw: Any) -> Receipt:
    return run_fakes(tmp_path, **kw)


def status(receipt: Receipt) -> dict[str, CheckStatus]:
    return {c.id: c.status for c in receipt.checks}


def test_a_clean_run_finds_the_base_and_the_old_version_as_they_were(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    retired: list[int] = []
    original = fake.FakeSampler.retire
    monkeypatch.setattr(fake.FakeSampler, "retire", lambda self, h: (retired.append(h.adapter_id), original(self, h)))
    receipt = run(tmp_path)
    assert receipt.verdict == Verdict.PASS
    names = [p.name for p in receipt.phases]
    assert names.index("updated") < names.index("base_after_sync") < names.index("old_after_sync") < names.index(
        "target.q_proj") < names.index("base_after_coverage")
    s = status(receipt)
    assert s["D.base_kept"] == s["D.base_kept.coverage"] == s["D.old_kept"] == CheckStatus.PASS
    assert receipt.comparisons["D.stale_vs_old_after_sync"].max_abs == 0
    v0, v1 = (next(a.adapter_id for a in receipt.adapters if a.version == v) for v in (0, 1))
    assert retired.count(v0) == 1 and retired.index(v0) < retired.index(v1)  # retired once scored, before coverage


def test_a_sync_that_changes_the_base_fails_delivery_and_says_so(tmp_path: Path) -> None:
    receipt = run(tmp_path, inject="base-changed")
    check = next(c for c in receipt.checks if c.id == "D.base_kept")
    assert check.status == CheckStatus.FAIL and check.reason.startswith("the sync changed the engine's base model")
    assert receipt.verdicts is not None and receipt.verdicts.sync.verdict == Verdict.FAIL


def test_an_old_name_that_follows_the_new_adapter_is_named(tmp_path: Path) -> None:
    receipt = run(tmp_path, inject="old-name-follows")
    check = next(c for c in receipt.checks if c.id == "D.old_kept")
    assert check.status == CheckStatus.FAIL and check.reason.startswith("an old adapter's name serves the new weights")
    assert status(receipt)["D.base_kept"] == CheckStatus.PASS and receipt.verdict == Verdict.FAIL


def test_only_modes_that_keep_versions_score_the_old_one_and_merged_modes_neither(tmp_path: Path) -> None:
    inplace = run(tmp_path, sync="inplace")
    assert "old_after_sync" not in [p.name for p in inplace.phases] and "D.base_kept" in status(inplace)
    merged = run(tmp_path, sync="merged")
    assert not {"D.base_kept", "D.old_kept"} & set(status(merged)) and merged.verdict == Verdict.PASS
    assert "old-name-follows" not in faults_for("inplace") and "base-changed" not in faults_for("merged")
    assert {"old-name-follows", "base-changed"} <= set(faults_for("new-id"))


def test_a_skipped_sync_leaves_no_old_version_to_score(tmp_path: Path) -> None:
    receipt = run(tmp_path, inject="skip-sync")
    assert "old_after_sync" not in [p.name for p in receipt.phases] and "D.old_kept" not in status(receipt)


def test_with_a_users_adapter_the_base_after_sync_is_compared_with_the_adapters_base(tmp_path: Path) -> None:
    folder = tmp_path / "start"
    trainer = fake.FakeTrainer(config.load(None), None, 0, {})  # the fake trainer's own export: a valid start
    trainer.perturb(0.02, 3)
    trainer.export_adapter(folder)
    receipt = run(tmp_path, adapter=folder)
    assert receipt.comparisons["D.adapter_base_vs_after_sync"].max_abs == 0
    assert status(receipt)["D.base_kept"] == CheckStatus.PASS


def test_a_weight_version_that_did_not_move_across_the_sync_is_reported(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    quiet = run(tmp_path)
    assert [a.weight_version for a in quiet.adapters] == [None] * len(quiet.adapters)
    assert not [line for line in findings.of_receipt(quiet) if "weight version" in line]
    monkeypatch.setattr(fake.FakeSampler, "reported_weight_version", "step-7")
    receipt = run(tmp_path, force=True)
    assert {a.weight_version for a in receipt.adapters} == {"step-7"} and receipt.verdict == Verdict.PASS
    assert any(line.startswith("the engine's weight version did not move across the sync ('step-7'")
               for line in findings.of_receipt(receipt))
    moved = [a.model_copy(update={"weight_version": f"v{a.version}"}) for a in receipt.adapters]
    assert findings.weight_version_line(moved) is None


WRONG_EXPORTS = [("wrong-scale", "lora_alpha is "),
                 ("wrong-direction", "tensors with other values: layers 0-1; modules"),
                 ("drop-target", "tensors missing: layers 0-1; modules q_proj (")]


@pytest.mark.parametrize(("fault", "says"), WRONG_EXPORTS)
def test_a_wrong_export_is_named_from_the_file_the_engine_was_handed(tmp_path: Path, fault: str, says: str) -> None:
    receipt = run(tmp_path, inject=fault)
    synced = next(a for a in receipt.adapters if a.version == 1)
    assert synced.file_differences and any(says in d for d in synced.file_differences)
    assert any(line.startswith("the adapter file the sync handed the engine is not the trainer's adapter")
               for line in findings.of_receipt(receipt))


def test_a_right_file_read_wrong_by_the_engine_is_the_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = run(tmp_path)
    assert next(a for a in clean.adapters if a.version == 1).file_differences == []
    assert not [line for line in findings.of_receipt(clean) if line.startswith("the adapter file")]
    right = fake._coefficients  # every load the engine makes reads B at 0.9: the file itself is right
    monkeypatch.setattr(fake, "_coefficients", lambda config, tensors: {
        k: 0.9 * v for k, v in right(config, tensors).items()})
    receipt = run(tmp_path, force=True)
    assert receipt.verdict == Verdict.FAIL
    assert any("holds exactly the trainer's tensors" in line for line in findings.of_receipt(receipt))


def test_a_file_rounded_to_its_dtype_is_the_trainers_and_one_moved_further_is_not(tmp_path: Path) -> None:
    import struct

    from lora_parity.models import adapter_files as af
    from lora_parity.models import export_check

    values = [0.1, -3.3, 1e-3, 0.0]
    raw = ("F32", [2, 2], struct.pack("<4f", *values))
    bf16 = af.Tensor.from_floats("BF16", [2, 2], [v * (1 + 2**-9) for v in values])
    folder = tmp_path / "a"
    af.write_adapter(folder, {"r": 2, "lora_alpha": 4}, {"x.lora_A.weight": bf16})
    assert export_check.differences(folder, {"x.lora_A.weight": raw}, 2, 4.0) == []
    af.write_adapter(folder, {"r": 2, "lora_alpha": 4}, {"x.lora_A.weight": af.Tensor.from_floats(
        "BF16", [2, 2], [v * 1.02 for v in values])})
    assert export_check.differences(folder, {"x.lora_A.weight": raw}, 2, 4.0) == [
        "1 tensors with other values: x.lora_A.weight"]
    # Handed nothing to compare (a payload dropped on the way), the file side never reads as "exactly the trainer's".
    af.write_adapter(folder, {"r": 2, "lora_alpha": 4}, {})
    assert export_check.differences(folder, {}, 2, 4.0) == ["nothing compared: the trainer handed no LoRA tensors"]
    names = ["m.layers.1.mlp.down_proj.lora_B.weight", "m.layers.2.self_attn.q_proj.lora_B.weight",
             "m.layers.4.mlp.down_proj.lora_B.weight"]
    assert export_check.where(names) == "layers 1-2, 4; modules down_proj, q_proj (lora_B)"


# The merged modes: the run ends by giving the sampler its checkpoint's base weights back and scoring the base route.

def count_resets(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """One entry per `reset_base` the fake sampler is asked for (the checkpoint's base weights reloaded)."""
    resets: list[str] = []
    original = fake.FakeSampler.reset_base
    monkeypatch.setattr(fake.FakeSampler, "reset_base", lambda self: (resets.append("reset"), original(self))[1])
    return resets


def restored(receipt: Receipt) -> Any:
    return next(c for c in receipt.checks if c.id == "D.base_restored")


@pytest.mark.parametrize("mode", ["merged", "memory"])
def test_a_merged_run_ends_with_the_base_weights_back_and_scores_them(tmp_path: Path, mode: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    resets = count_resets(monkeypatch)
    receipt = run(tmp_path, sync=mode)
    assert receipt.verdict == Verdict.PASS
    assert [p.name for p in receipt.phases][-2:] == ["restore_base", "base_after_restore"]
    check = restored(receipt)
    assert check.status == CheckStatus.PASS and check.elements is not None and check.elements > 0
    assert check.name == "the engine's base model after the run gives its first base scores"
    assert receipt.comparisons["D.base_vs_after_restore"].max_abs == 0
    assert len(resets) == 1  # the restore phase reloaded the base weights; retire did not reload them again
    assert receipt.verdicts is not None and "D.base_restored" in receipt.verdicts.sync.decided_by


def test_a_restore_that_leaves_the_merged_weights_fails_delivery_and_retire_still_restores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resets = count_resets(monkeypatch)
    receipt = run(tmp_path, sync="merged", inject="base-not-restored")
    check = restored(receipt)
    assert check.status == CheckStatus.FAIL
    assert check.reason.startswith("the engine did not get its base weights back after the run")
    assert [c.id for c in receipt.checks if c.status != CheckStatus.PASS] == ["D.base_restored"]
    assert receipt.verdicts is not None and receipt.verdicts.sync.verdict == Verdict.FAIL
    assert len(resets) == 1  # the fault kept the merged weights for the phase; retire gave them back after it


@pytest.mark.parametrize("phase", ["restore_base", "base_after_restore"])
def test_a_run_stopped_in_the_restore_still_leaves_the_checkpoints_weights(tmp_path: Path, phase: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    resets = count_resets(monkeypatch)
    receipt = run(tmp_path, sync="merged", inject=f"crash-at={phase}")
    assert receipt.verdict == Verdict.ERROR and "D.base_restored" not in status(receipt)
    assert len(resets) == 1  # once: by retire where the crash came before the restore, else by the restore alone


def test_a_sampled_run_restores_where_its_base_scores_are_the_checkpoints(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.run import probes

    monkeypatch.setattr(probes, "checkpoint_tokenizer",  # the fakes' config has no tokenizer: characters as ids
                        lambda cfg, kind="text": (lambda text: [ord(ch) % 64 for ch in text], "toy"))
    resets = count_resets(monkeypatch)
    zero = run(tmp_path, sync="merged", probes="sampled")
    assert restored(zero).status == CheckStatus.PASS and len(resets) == 1
    # With a start (here the warm one of --update step), version 0 is published before the base is scored, so
    # those scores carry it merged in: the restore is not compared with them; retire still gives the weights back.
    warm = run(tmp_path, sync="merged", probes="sampled", update="step", force=True)
    assert "base_after_restore" not in warm.scores and "D.base_restored" not in status(warm) and len(resets) == 2


def test_the_selftest_catches_a_base_left_merged_and_only_the_merged_modes_get_it(tmp_path: Path) -> None:
    from lora_parity.backends.base import BackendTraits
    from lora_parity.run.selftest import selftest

    result = selftest(RunOptions(**FAKE, sync="memory"), tmp_path, faults=["base-not-restored"])
    clean, fault = result.rows
    assert clean.caught and fault.fault == "base-not-restored" and fault.caught, fault
    assert fault.expected == "fail: D.base_restored"
    for mode in ("merged", "memory"):
        assert "base-not-restored" in faults_for(mode)
        assert "base-not-restored" not in faults_for(mode, BackendTraits(base_unavailable="no base route"))
    for mode in ("new-id", "inplace", "tensors"):
        assert "base-not-restored" not in faults_for(mode)


def test_the_adapter_modes_have_no_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resets = count_resets(monkeypatch)
    for mode in ("new-id", "inplace"):
        receipt = run(tmp_path, sync=mode)
        assert not {"restore_base", "base_after_restore"} & {p.name for p in receipt.phases}
        assert "D.base_restored" not in status(receipt) and "base_after_restore" not in receipt.scores
    assert resets == []


def test_with_a_users_adapter_the_restored_base_is_compared_with_the_adapters_base(tmp_path: Path) -> None:
    folder = tmp_path / "start"
    trainer = fake.FakeTrainer(config.load(None), None, 0, {})
    trainer.perturb(0.02, 3)
    trainer.export_adapter(folder)
    receipt = run(tmp_path, adapter=folder, sync="merged")
    assert receipt.comparisons["D.adapter_base_vs_after_restore"].max_abs == 0
    assert "D.base_vs_after_restore" not in receipt.comparisons and restored(receipt).status == CheckStatus.PASS


def test_receipts_made_before_the_restore_verify_and_the_check_is_recomputed(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from lora_parity.evidence.receipt import compute_digest
    from lora_parity.run import engine_state
    from lora_parity.util.errors import ReceiptError

    new = tmp_path / "new.json"
    execute(RunOptions(**FAKE, sync="merged", out=new))
    with monkeypatch.context() as m:  # the sequence as it was: no restore phase
        m.setattr(engine_state, "after_run", lambda run: None)
        old = execute(RunOptions(**FAKE, sync="merged", out=tmp_path / "old.json")).receipt
    assert "base_after_restore" not in old.scores and "D.base_restored" not in status(old)
    assert verify(tmp_path / "old.json").verdict == Verdict.PASS
    data = json.loads(new.read_text())  # the check removed, the receipt sealed again: verify makes it anyway
    data["checks"] = [c for c in data["checks"] if c["id"] != "D.base_restored"]
    data["digest"] = compute_digest(data)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    with pytest.raises(ReceiptError, match=r"D\.base_restored"):
        verify(edited)
