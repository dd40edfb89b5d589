"""Every check fires on its injected fault: the whole matrix on the fake backends, in milliseconds."""

import json
from pathlib import Path

import pytest

from lora_parity.backends.fake import FakeSampler, FakeTrainer
from lora_parity.evidence.receipt import CheckStatus, PhaseStatus, Verdict
from lora_parity.run.faults import FAULTS, faults_for
from lora_parity.run.runner import RunOptions, execute
from lora_parity.run.selftest import selftest
from lora_parity.verdict.check_rules import compared_nothing
from lora_parity.verdict.verify import verify

pytestmark = pytest.mark.unit

FAKE = {"trainer": "fake", "sampler": "fake"}


def test_selftest_catches_every_fault_on_fakes(tmp_path: Path) -> None:
    result = selftest(RunOptions(**FAKE), tmp_path, repeat=3)
    assert [r.fault for r in result.rows] == ["none #1", "none #2", "none #3",
                                              *faults_for("new-id", FakeSampler.traits, trainer=FakeTrainer.traits)]
    assert all(r.caught for r in result.rows), [r for r in result.rows if not r.caught]
    assert result.identical_repeats and result.ok
    for row in result.rows:
        verify(Path(row.receipt))  # every receipt the matrix wrote is intact


def test_selftest_without_per_target_coverage_catches_every_fault(tmp_path: Path) -> None:
    """drop-target is then caught by T.<target>.moved on coverage of the dropped target alone (C cannot
    name a dropped target whose share of the change is small next to the noise)."""
    result = selftest(RunOptions(**FAKE, per_target=False), tmp_path)
    assert all(r.caught for r in result.rows), [r for r in result.rows if not r.caught]
    drop = next(r for r in result.rows if r.fault == "drop-target")
    assert drop.expected == "fail: T.q_proj.moved" and result.ok
    receipt = json.loads(Path(drop.receipt).read_text())
    assert [p["name"] for p in receipt["phases"] if p["name"].startswith("target.")] == ["target.q_proj"]
    clean = json.loads(Path(result.rows[0].receipt).read_text())
    assert not [p for p in clean["phases"] if p["name"].startswith("target.")]


@pytest.mark.parametrize("fault", [f for f in faults_for("new-id", FakeSampler.traits, trainer=FakeTrainer.traits)
                                   if not f.startswith("crash-at")])
def test_each_fault_trips_its_check(fault: str, tmp_path: Path) -> None:
    receipt = execute(RunOptions(**FAKE, inject=fault, out=tmp_path / "r.json")).receipt
    spec = FAULTS[fault]
    assert receipt.verdict.value == spec.verdict
    assert receipt.injected_fault == fault
    status = {c.id: c.status for c in receipt.checks}
    # Where the fault must leave the run inconclusive, a declared check may also be one that compared nothing.
    empty = {c.id for c in receipt.checks if compared_nothing(c)} if spec.verdict == "inconclusive" else set()
    for entry in spec.caught_by:  # X|Y: either fails
        either = entry.format(target="q_proj").split("|")
        assert any(status[c] in (CheckStatus.FAIL, CheckStatus.INCONCLUSIVE) or c in empty for c in either), (
            entry, status)
    for check in spec.must_pass:
        assert status[check] == CheckStatus.PASS


def test_one_token_fault_hides_in_the_mean(tmp_path: Path) -> None:
    receipt = execute(RunOptions(**FAKE, inject="one-token", out=tmp_path / "r.json")).receipt
    a = receipt.comparisons["A.trainer_vs_sampler"]
    assert a.mean_abs <= receipt.budgets.mean < a.max_abs
    assert a.argmax == [0, 3]


def test_clean_run_would_fail_if_the_fault_checks_were_removed(tmp_path: Path) -> None:
    # The skip-sync fault differs from a clean run only in C and X: without those checks it would pass.
    receipt = execute(RunOptions(**FAKE, inject="skip-sync", out=tmp_path / "r.json")).receipt
    failing = {c.id for c in receipt.checks if c.status == CheckStatus.FAIL}
    assert "X.sync.identical" in failing and all(c.startswith(("C.", "X.")) for c in failing)


@pytest.mark.parametrize("phase", ["base", "publish_zero", "perturb", "stale", "sync", "updated", "fresh",
                                   "target.v_proj"])
def test_crash_in_any_phase_still_writes_a_receipt(phase: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    receipt = execute(RunOptions(**FAKE, inject=f"crash-at={phase}", out=out)).receipt
    assert receipt.verdict == Verdict.ERROR
    assert receipt.error == f"phase {phase}: injected crash in phase {phase}"
    assert receipt.phases[-1].name == phase and receipt.phases[-1].status == PhaseStatus.ERROR
    assert all(p.status == PhaseStatus.OK for p in receipt.phases[:-1])
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert verify(out).verdict == Verdict.ERROR


def test_nan_is_an_error_with_a_clear_message(tmp_path: Path) -> None:
    receipt = execute(RunOptions(**FAKE, inject="nan", out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.ERROR
    assert "non-finite score nan at sequence 0, position 5" in (receipt.error or "")
    assert "base" not in receipt.scores  # NaN never reaches the receipt


def test_perturbation_refuses_nonzero_b_and_trainable_base() -> None:
    from lora_parity.backends.fake import FakeTrainer
    from lora_parity.models import config
    from lora_parity.util.errors import PhaseError

    trainer = FakeTrainer(config.load(None), None, 0, {})
    first = trainer.perturb(0.01, 0)
    assert first.num_tensors == 7 * 2 and first.num_elements == 7 * 2 * 8  # 7 targets x 2 layers
    with pytest.raises(PhaseError, match="non-zero before the update"):
        trainer.perturb(0.01, 0)
    trainer.zero_b()
    trainer.trainable_base = True
    with pytest.raises(PhaseError, match="non-adapter parameter"):
        trainer.perturb(0.01, 0)


def test_perturbation_is_seeded_per_tensor() -> None:
    from lora_parity.backends.fake import FakeTrainer
    from lora_parity.models import config

    cfg = config.load(None)
    a, b = FakeTrainer(cfg, None, 0, {}), FakeTrainer(cfg, None, 0, {})
    a.perturb(0.01, 7)
    b.perturb(0.01, 7)
    assert a.params == b.params
    b.zero_b()
    b.perturb(0.01, 8)
    assert a.params != b.params
