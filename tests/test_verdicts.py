"""The two verdicts and the measured-noise rules (docs/verdicts.md): hand-computed expectations, and
every fault still caught on the fake backends when the sampler carries bf16-like noise."""

import json
import math
from pathlib import Path
from typing import Any

import pytest

from lora_parity.backends.fake import FakeSampler
from lora_parity.evidence.receipt import (
    ATriangulation,
    Budgets,
    CheckStatus,
    ComparisonStats,
    CRelative,
    Verdict,
    compute_digest,
)
from lora_parity.models import config
from lora_parity.run.faults import FAULTS
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ConfigError, ReceiptError
from lora_parity.verdict import check_rules, checks
from lora_parity.verdict.verify import verify

pytestmark = pytest.mark.unit

ABSOLUTE = Budgets(mean=0.05, p99=0.25, max=0.5, min_stimulus=0.1, repeat_max=0.25, noise_floor=1e-4,
                   noise_factor=3, min_delta_cosine=0.95, max_delta_scale_error=0.1, max_delta_rel_l2=0.35,
                   min_target_snr=3)
RELATIVE = ABSOLUTE.model_copy(update={
    "c_relative": CRelative(factor=2.0, floor=0.02),
    "a_triangulation": ATriangulation(factor=1.5, mean=0.25, p99=1.0, max=2.0),
    "target_noise_k": 2.0,
})


def cmp(mean: float, p99: float, mx: float) -> ComparisonStats:
    return ComparisonStats(a="x", b="y", n=192, mean_abs=mean, p50=mean, p99=p99, max_abs=mx, argmax=[0, 0],
                           frac_over=0.0, k3_kl=0.0, mult_prob_error=1.0)


def status(ev: checks.Evaluation) -> dict[str, CheckStatus]:
    return {c.id: c.status for c in ev.checks}


# --- C relative to A ---------------------------------------------------------------------------

def test_c_budgets_are_factor_times_a_plus_floor() -> None:
    # SmolLM2-135M bf16: A mean 0.08, p99 0.31, max 0.60 -> C budgets 0.18, 0.64, 1.22.
    th = check_rules.c_parity_thresholds(RELATIVE, cmp(0.08, 0.31, 0.60))
    assert th["mean"].budget == pytest.approx(0.18)
    assert th["p99"].budget == pytest.approx(0.64)
    assert th["max"].budget == pytest.approx(1.22)
    assert th["mean"].note == "2 x A's 0.08 + 0.02"


def test_c_budgets_stay_absolute_without_the_rule_or_without_a() -> None:
    assert check_rules.c_parity_thresholds(ABSOLUTE, cmp(0.08, 0.31, 0.6))["mean"].budget == 0.05
    assert check_rules.c_parity_thresholds(RELATIVE, None)["max"].budget == 0.5


def test_c_passes_at_the_zero_init_level_and_fails_above_it() -> None:
    comparisons = {"A.trainer_vs_sampler": cmp(0.08, 0.31, 0.60), "C.trainer_vs_sampler": cmp(0.077, 0.30, 0.75)}
    got = {c.id: c for c in checks.compute_checks(comparisons, {}, RELATIVE)}
    assert all(got[f"C.parity.{s}"].status == CheckStatus.PASS for s in ("mean", "p99", "max"))
    # A missing sync: C moves by the whole stimulus (0.24), above 2 x 0.08 + 0.02 = 0.18.
    comparisons["C.trainer_vs_sampler"] = cmp(0.24, 0.6, 0.9)
    got = {c.id: c for c in checks.compute_checks(comparisons, {}, RELATIVE)}
    assert got["C.parity.mean"].status == CheckStatus.FAIL
    assert got["C.parity.mean"].budget == pytest.approx(0.18)
    assert "(2 x A's 0.08 + 0.02)" in got["C.parity.mean"].reason


# --- A triangulated against fp32 ----------------------------------------------------------------

def test_a_within_its_precision_passes_and_names_no_side() -> None:
    # The measured SmolLM2 numbers: A 0.078, trainer 0.077 and sampler 0.066 from fp32 -> budget 1.5 x 0.077.
    comparisons = {"A.trainer_vs_sampler": cmp(0.078, 0.31, 0.6), "R.trainer_vs_fp32": cmp(0.077, 0.30, 0.5),
                   "R.sampler_vs_fp32": cmp(0.066, 0.25, 0.4)}
    got = {c.id: c for c in checks.compute_checks(comparisons, {}, RELATIVE)}
    assert got["A.parity.mean"].budget == pytest.approx(0.1155)
    assert got["A.parity.p99"].budget == pytest.approx(0.45)
    assert got["A.parity.max"].budget == 2.0
    assert {i: c.status for i, c in got.items() if i.startswith(("A.parity", "A.fp32"))} == dict.fromkeys(
        ["A.parity.mean", "A.parity.p99", "A.parity.max", "A.fp32.trainer.mean", "A.fp32.trainer.p99",
         "A.fp32.trainer.max", "A.fp32.sampler.mean", "A.fp32.sampler.p99", "A.fp32.sampler.max"], CheckStatus.PASS)


def test_a_beyond_its_precision_fails_and_names_the_farther_side() -> None:
    comparisons = {"A.trainer_vs_sampler": cmp(0.2, 0.4, 0.6), "R.trainer_vs_fp32": cmp(0.05, 0.2, 0.3),
                   "R.sampler_vs_fp32": cmp(0.1, 0.3, 0.5)}
    got = {c.id: c for c in checks.compute_checks(comparisons, {}, RELATIVE)}
    assert got["A.parity.mean"].status == CheckStatus.FAIL  # 0.2 > 1.5 x 0.1
    assert "the sampler is farther from fp32 (trainer 0.05, sampler 0.1)" in got["A.parity.mean"].reason


def test_one_side_far_from_fp32_fails_its_ceiling_even_when_a_is_within_factor() -> None:
    # The sampler is off by 9 nats on one token: A's max and the sampler's max from fp32 both carry it.
    comparisons = {"A.trainer_vs_sampler": cmp(0.12, 0.3, 9.0), "R.trainer_vs_fp32": cmp(0.07, 0.3, 0.5),
                   "R.sampler_vs_fp32": cmp(0.11, 0.3, 9.0)}
    got = {c.id: c.status for c in checks.compute_checks(comparisons, {}, RELATIVE)}
    assert got["A.parity.max"] == CheckStatus.FAIL
    assert got["A.fp32.sampler.max"] == CheckStatus.FAIL and got["A.fp32.trainer.max"] == CheckStatus.PASS


def test_without_the_reference_a_keeps_its_absolute_budgets() -> None:
    got = {c.id: c for c in checks.compute_checks({"A.trainer_vs_sampler": cmp(0.078, 0.31, 0.6)}, {}, RELATIVE)}
    assert got["A.parity.mean"].status == CheckStatus.FAIL and got["A.parity.mean"].budget == 0.05
    assert not any(i.startswith("A.fp32.") for i in got)


# --- noise-derived delta thresholds ---------------------------------------------------------------

@pytest.mark.parametrize(("eps", "norm", "cosine", "scale"), [
    (0.1, 1.0, 0.95, 0.2),                          # k eps/|t| = 0.2: cos(asin 0.2) = 0.980 > 0.95 keeps 0.95
    (0.25, 1.0, math.sqrt(1 - 0.25), 0.5),          # 0.5: cos(asin 0.5) = 0.866
    (0.01, 1.0, 0.95, 0.1),                         # 0.02: both fixed budgets stand
])
def test_delta_thresholds_follow_the_noise(eps: float, norm: float, cosine: float, scale: float) -> None:
    th = check_rules.delta_thresholds(RELATIVE, eps, norm)
    assert th.cosine.budget == pytest.approx(cosine)
    assert th.scale.budget == pytest.approx(scale)
    assert th.rel_l2.budget == pytest.approx(max(0.35, 2 * eps / norm))
    assert not th.undecidable


def test_delta_thresholds_fixed_without_k_and_undecidable_when_noise_is_as_large_as_the_change() -> None:
    assert check_rules.delta_thresholds(ABSOLUTE, 0.25, 1.0).cosine.budget == 0.95
    assert check_rules.delta_thresholds(RELATIVE, 0.5, 1.0).undecidable  # 2 x 0.5 / 1.0 = 1


def _target_scores(effect: float, angle_noise: float) -> dict[str, list[list[float]]]:
    """Zero-init disagreement of L2 0.1 (one position off by 0.1); one target whose trainer change has L2
    `effect`, and whose sampler change is the trainer's plus an orthogonal part of L2 `angle_noise`."""
    n = 100
    base = [-2.0] * n
    zero = list(base)
    zero[99] -= 0.1
    t_change = [0.0] * n
    t_change[0] = effect
    s_change = list(t_change)
    s_change[1] = angle_noise
    return {"zero": [zero], "trainer_zero": [base],
            "target.k_proj.trainer": [[b - d for b, d in zip(base, t_change, strict=True)]],
            "target.k_proj.sampler": [[z - d for z, d in zip(zero, s_change, strict=True)]]}


def test_a_cosine_noise_explains_is_not_a_failure_and_one_it_cannot_is() -> None:
    # 270M model: k_proj cosine 0.86 (tan = 0.593). eps 0.1, |t| 0.35: k eps/|t| = 0.571 -> threshold
    # cos(asin 0.571) = 0.821: noise explains it (the scale error 0.16 < 0.571 too).
    ev = checks.evaluate(_target_scores(0.35, 0.35 * 0.593), RELATIVE, errored=False)
    got = {c.id: c for c in ev.checks}
    assert got["T.k_proj.cosine"].observed == pytest.approx(0.86, abs=1e-3)
    assert got["T.k_proj.cosine"].budget == pytest.approx(math.cos(math.asin(0.2 / 0.35)))
    assert got["T.k_proj.cosine"].status == CheckStatus.PASS
    assert "noise allows 2 x 0.1 / 0.35" in got["T.k_proj.cosine"].reason
    # The same angle on a change 3x larger (|t| 1.05, k eps/|t| = 0.19): noise cannot explain it.
    ev = checks.evaluate(_target_scores(1.05, 1.05 * 0.593), RELATIVE, errored=False)
    assert status(ev)["T.k_proj.cosine"] == CheckStatus.FAIL
    # Old budgets (no target_noise_k): the fixed 0.95 decides, as before.
    ev = checks.evaluate(_target_scores(0.35, 0.35 * 0.593), ABSOLUTE, errored=False)
    assert status(ev)["T.k_proj.cosine"] == CheckStatus.FAIL


# --- groups and verdicts --------------------------------------------------------------------------

def test_groups_follow_the_id_prefix() -> None:
    assert [check_rules.group_of(i) for i in ("A.parity.max", "A.fp32.sampler.mean", "A.noise.trainer_repeat",
                                              "A.zero_adapter_noop", "B.withheld", "C.parity.mean", "T.q_proj.moved",
                                              "S.trainer_kept")] == ["numerics"] * 3 + ["sync"] * 5


def test_bf16_drift_alone_fails_numerics_not_sync() -> None:
    comparisons = {"A.trainer_vs_sampler": cmp(0.13, 0.45, 0.55), "C.trainer_vs_sampler": cmp(0.12, 0.4, 0.5)}
    ev_checks = checks.compute_checks(comparisons, {}, RELATIVE)
    verdicts = check_rules.group_verdicts(ev_checks, errored=False)
    assert verdicts.numerics.verdict == Verdict.FAIL
    assert verdicts.numerics.decided_by == ["A.parity.mean", "A.parity.p99", "A.parity.max"]
    assert verdicts.sync.verdict == Verdict.INCONCLUSIVE  # B, the deltas... were not reached
    assert check_rules.combined(verdicts) == Verdict.FAIL
    assert check_rules.combined(check_rules.group_verdicts(ev_checks, errored=True)) == Verdict.ERROR


# --- the fake backends with bf16-like noise -------------------------------------------------------

@pytest.fixture
def noisy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A sampler off by N(0, 0.08) per position (A mean about 0.06, above the 0.05 absolute budget) and a
    perturbation 3x the tiny config's, so the stimulus is about 6x A, as calibrated runs are."""
    monkeypatch.setattr(FakeSampler, "noise", 0.08)
    cfg = (config.configs_dir() / "tiny-qwen3.yaml").read_text().replace("  std: 0.02\n", "  std: 0.06\n")
    path = tmp_path / "noisy.yaml"
    path.write_text(cfg)
    return path


def _run(model: Path, tmp: Path, inject: str | None = None, per_target: bool = True) -> Any:
    return execute(RunOptions(model=str(model), trainer="fake", sampler="fake", budgets="bf16", inject=inject,
                              per_target=per_target, out=tmp / f"{inject}.json")).receipt


def _with_reference(receipt: Any) -> checks.Evaluation:
    # The fake trainer computes the exact model, so its zero-init scores are the fp32 reference.
    scores = {**receipt.scores, "reference_fp32": receipt.scores["trainer_zero"]}
    return checks.evaluate(scores, receipt.budgets, errored=False)


def test_bf16_like_clean_run_passes_sync_and_with_the_reference_passes(noisy: Path, tmp_path: Path) -> None:
    receipt = _run(noisy, tmp_path, per_target=False)
    assert receipt.budgets.profile == "bf16"
    assert receipt.comparisons["A.trainer_vs_sampler"].mean_abs > receipt.budgets.mean  # A is large
    assert receipt.verdicts.sync.verdict == Verdict.PASS
    assert receipt.verdicts.numerics.verdict == Verdict.FAIL  # no reference: A's absolute budgets
    ev = _with_reference(receipt)
    assert ev.verdicts.numerics.verdict == Verdict.PASS and ev.verdict == Verdict.PASS
    verify(tmp_path / "None.json")


@pytest.mark.parametrize("fault", ["skip-sync", "reuse-adapter-id", "wrong-scale", "wrong-direction", "drop-target",
                                   "leak", "nonzero-init"])
def test_sync_faults_are_caught_by_sync_under_bf16_noise(fault: str, noisy: Path, tmp_path: Path) -> None:
    receipt = _run(noisy, tmp_path, fault)
    assert receipt.verdicts.sync.verdict == Verdict.FAIL, receipt.verdicts
    # Even where the fp32 reference clears A, the run fails.
    assert _with_reference(receipt).verdict == Verdict.FAIL
    failed = set(receipt.verdicts.sync.decided_by)
    expected = {c.format(target="q_proj") for c in FAULTS[fault].caught_by}
    if fault == "drop-target":
        # One of seven small targets moves C by less than 2 x A: the per-target check catches it alone.
        expected = {"T.q_proj.moved"}
    assert expected <= failed, (expected, failed)


def test_one_token_fault_is_caught_by_a_under_bf16_noise(noisy: Path, tmp_path: Path) -> None:
    receipt = _run(noisy, tmp_path, "one-token", per_target=False)
    assert "A.parity.max" in receipt.verdicts.numerics.decided_by
    ev = _with_reference(receipt)  # the sampler is the side off: its distance from fp32 says so
    failed = {c.id: c for c in ev.checks if c.status == CheckStatus.FAIL}
    assert {"A.parity.max", "A.fp32.sampler.max"} <= set(failed) and "A.fp32.trainer.max" not in failed
    assert ev.verdict == Verdict.FAIL


def test_frozen_trainer_stays_inconclusive_under_bf16_noise(noisy: Path, tmp_path: Path) -> None:
    ev = _with_reference(_run(noisy, tmp_path, "frozen-trainer", per_target=False))
    assert ev.verdicts.sync.verdict == Verdict.INCONCLUSIVE and "B.stimulus" in ev.verdicts.sync.decided_by


# --- profiles, receipts, verify -------------------------------------------------------------------

def test_profiles_load_and_bf16_configs_use_the_bf16_profile() -> None:
    assert config.profile_budgets("seed").mean == 0.05 and config.profile_budgets("seed").min_target_snr is None
    assert config.profile_budgets("fp32").c_relative is None
    bf16 = config.profile_budgets("bf16")
    assert bf16.c_relative == CRelative(factor=2.0, floor=0.02) and bf16.target_noise_k == 2.0
    for name in ("smollm2-135m-bf16", "qwen3-0.6b-synth", "qwen3-8b-synth", "tiny-glm-dsa"):
        assert config.load(name).budgets == bf16, name
    assert config.load("tiny-qwen3", budgets="seed").budgets.profile == "seed"
    with pytest.raises(ConfigError, match="unknown budget profile 'bf17'"):
        config.load("tiny-qwen3", budgets="bf17")


def test_verify_rechecks_the_verdicts(tmp_path: Path) -> None:
    execute(RunOptions(trainer="fake", sampler="fake", out=tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdicts"]["sync"]["verdict"] == "pass" and data["verdicts"]["numerics"]["verdict"] == "pass"
    data["verdicts"]["sync"]["decided_by"] = ["B.withheld"]
    data["digest"] = compute_digest(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ReceiptError, match="verdicts"):
        verify(tmp_path / "bad.json")
    # A receipt made before the verdicts existed (none recorded) verifies, judged by its checks.
    del data["verdicts"]
    data["digest"] = compute_digest(data)
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert verify(tmp_path / "old.json").verdict == Verdict.PASS


def test_json_summary_carries_both_verdicts(tmp_path: Path) -> None:
    from lora_parity.cli import output

    receipt = execute(RunOptions(trainer="fake", sampler="fake", inject="one-token", out=tmp_path / "r.json")).receipt
    summary = output.summary(receipt, "r.json")
    # The same token is off after sync too; C's mean, moved and delta checks pass, so that tail is numerics
    # (check_rules.tails_in_numerics), and the sync verdict passes.
    assert summary["verdicts"]["numerics"] == {"verdict": "fail", "decided_by": ["A.parity.max", "C.parity.max"]}
    assert summary["verdicts"]["sync"]["verdict"] == "pass"
