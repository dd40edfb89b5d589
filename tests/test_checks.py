import pytest

from lora_parity.evidence.receipt import Budgets, CheckStatus, Verdict
from lora_parity.verdict import checks

pytestmark = pytest.mark.unit

SEED_BUDGETS = Budgets(mean=0.05, p99=0.5, max=0.5, min_stimulus=0.05, repeat_max=1e-6, noise_floor=1e-6,
                       noise_factor=3, min_delta_cosine=0.99, max_delta_scale_error=0.05, max_delta_rel_l2=0.1)


def const(value: float, n: int = 192) -> list[list[float]]:
    return [[value] * n]


def clean_scores(n: int = 192) -> dict[str, list[list[float]]]:
    s = {k: const(-2.0, n) for k in ("base", "zero", "zero_repeat", "trainer_zero", "trainer_zero_repeat", "stale")}
    moved = [[-2.0 + 0.1 * ((i % 7) - 3) for i in range(n)]]
    s.update(trainer_updated=moved, updated=[list(moved[0])], updated_repeat=[list(moved[0])])
    return s


def by_id(ev: checks.Evaluation) -> dict[str, CheckStatus]:
    return {c.id: c.status for c in ev.checks}


def test_clean_scores_pass() -> None:
    ev = checks.evaluate(clean_scores(), SEED_BUDGETS, errored=False)
    assert ev.verdict == Verdict.PASS, [c for c in ev.checks if c.status != CheckStatus.PASS]


def test_one_bad_token_cannot_hide_in_the_mean() -> None:
    # The seed reviewer's regression: 192 positions, zero = stale = -2.0, trainer_updated = -1.9,
    # updated = trainer_updated except one position at -10.9.
    s = {k: const(-2.0) for k in ("base", "zero", "zero_repeat", "trainer_zero", "trainer_zero_repeat", "stale")}
    s["trainer_updated"] = const(-1.9)
    updated = const(-1.9)
    updated[0][17] = -10.9
    s["updated"], s["updated_repeat"] = updated, [list(updated[0])]
    ev = checks.evaluate(s, SEED_BUDGETS, errored=False)
    assert ev.comparisons["C.trainer_vs_sampler"].mean_abs == pytest.approx(0.046875)
    status = by_id(ev)
    assert status["C.parity.mean"] == CheckStatus.PASS
    assert status["C.parity.max"] == CheckStatus.FAIL
    assert ev.comparisons["C.trainer_vs_sampler"].argmax == [0, 17]
    assert ev.verdict == Verdict.FAIL


def test_small_stimulus_is_inconclusive_never_pass() -> None:
    s = clean_scores()
    tiny = [[-2.0 + 1e-3] * 192]
    s.update(trainer_updated=tiny, updated=[list(tiny[0])], updated_repeat=[list(tiny[0])])
    ev = checks.evaluate(s, SEED_BUDGETS, errored=False)
    assert by_id(ev)["B.stimulus"] == CheckStatus.INCONCLUSIVE
    assert ev.verdict == Verdict.INCONCLUSIVE


def test_frozen_trainer_is_inconclusive_not_fail() -> None:
    s = clean_scores()
    s.update(trainer_updated=const(-2.0), updated=const(-2.0), updated_repeat=const(-2.0))
    ev = checks.evaluate(s, SEED_BUDGETS, errored=False)
    status = by_id(ev)
    assert status["B.stimulus"] == CheckStatus.INCONCLUSIVE
    assert status["C.delta.cosine"] == CheckStatus.INCONCLUSIVE
    assert ev.verdict == Verdict.INCONCLUSIVE


def test_stale_sampler_fails_c_and_visible_update_fails_b() -> None:
    s = clean_scores()
    s["updated"], s["updated_repeat"] = const(-2.0), const(-2.0)
    assert by_id(checks.evaluate(s, SEED_BUDGETS, errored=False))["C.parity.mean"] == CheckStatus.FAIL
    s = clean_scores()
    s["stale"] = s["trainer_updated"]
    status = by_id(checks.evaluate(s, SEED_BUDGETS, errored=False))
    assert status["B.withheld"] == CheckStatus.FAIL


def test_noise_tolerance_scales_with_repeat_noise() -> None:
    s = clean_scores()
    s["zero_repeat"] = [[-2.0 + 1e-7] * 192]  # sampler repeat noise 1e-7, within repeat_max
    s["stale"] = [[-2.0 + 2.5e-7] * 192]  # within noise_factor x repeat noise of zero_repeat
    s["base"] = [[-2.0 + 3e-7] * 192]
    status = by_id(checks.evaluate(s, SEED_BUDGETS, errored=False))
    assert status["A.zero_adapter_noop"] == CheckStatus.PASS
    s["base"] = [[-2.0 + 5e-6] * 192]
    assert by_id(checks.evaluate(s, SEED_BUDGETS, errored=False))["A.zero_adapter_noop"] == CheckStatus.FAIL


def test_missing_phases_are_not_reached_and_error_wins() -> None:
    s = {k: v for k, v in clean_scores().items() if k in ("base", "zero", "zero_repeat")}
    ev = checks.evaluate(s, SEED_BUDGETS, errored=True)
    status = by_id(ev)
    assert status["A.parity.mean"] == CheckStatus.NOT_REACHED
    assert status["A.zero_adapter_noop"] == CheckStatus.PASS
    assert ev.verdict == Verdict.ERROR
    assert checks.evaluate(s, SEED_BUDGETS, errored=False).verdict == Verdict.INCONCLUSIVE


def test_per_target_checks_name_the_module() -> None:
    s = clean_scores()
    s["target.q_proj.trainer"] = s["trainer_updated"]
    s["target.q_proj.sampler"] = s["trainer_updated"]
    s["target.v_proj.trainer"] = s["trainer_updated"]
    s["target.v_proj.sampler"] = s["zero"]  # v_proj never reaches the sampler
    ev = checks.evaluate(s, SEED_BUDGETS, errored=False)
    status = by_id(ev)
    assert status["T.q_proj.moved"] == CheckStatus.PASS
    assert status["T.v_proj.moved"] == CheckStatus.FAIL
    assert ev.verdict == Verdict.FAIL


def _per_target_with_noise(trainer_effect: float, wrong_way: bool) -> dict[str, list[list[float]]]:
    """Trainer and sampler disagree by ±0.02 per position, in one pattern at zero-init and another
    after target q_proj alone moved the trainer by `trainer_effect` per position (the sampler the
    same way, or the opposite way)."""
    s = clean_scores()
    n = len(s["zero"][0])
    s["trainer_zero"] = [[-2.0 + (0.02 if i % 2 else -0.02) for i in range(n)]]
    s["trainer_zero_repeat"] = [list(s["trainer_zero"][0])]
    pattern = [((i % 5) - 2) / 2 for i in range(n)]
    sign = -1.0 if wrong_way else 1.0
    s["target.q_proj.trainer"] = [[t + trainer_effect * p for t, p in zip(s["trainer_zero"][0], pattern, strict=True)]]
    s["target.q_proj.sampler"] = [[-2.0 + sign * trainer_effect * p + (0.02 if i % 3 else -0.02)
                                   for i, p in enumerate(pattern)]]
    return s


@pytest.mark.parametrize("snr", [None, 3.0])
def test_per_target_direction_lost_in_noise_is_inconclusive_not_fail(snr: float | None) -> None:
    budgets = SEED_BUDGETS.model_copy(update={"mean": 0.05, "min_target_snr": snr})
    # Effect 0.01 per position under a 0.02 disagreement: the direction cannot be told.
    status = by_id(checks.evaluate(_per_target_with_noise(0.01, wrong_way=False), budgets, errored=False))
    assert status["T.q_proj.moved"] == CheckStatus.PASS
    expected = CheckStatus.FAIL if snr is None else CheckStatus.INCONCLUSIVE  # None: receipts before the budget
    assert status["T.q_proj.cosine"] == expected


def test_per_target_wrong_direction_above_noise_still_fails() -> None:
    budgets = SEED_BUDGETS.model_copy(update={"min_target_snr": 3.0})
    ev = checks.evaluate(_per_target_with_noise(0.5, wrong_way=True), budgets, errored=False)
    status = by_id(ev)
    assert status["T.q_proj.cosine"] == CheckStatus.FAIL and ev.verdict == Verdict.FAIL
    ev = checks.evaluate(_per_target_with_noise(0.5, wrong_way=False), budgets, errored=False)
    assert by_id(ev)["T.q_proj.cosine"] == CheckStatus.PASS


def test_the_gpu_glm_receipts_query_targets_are_within_noise() -> None:
    """The GLM-5.3-architecture GPU receipt with the fixed std 0.02 (bf16 profile): the query projections'
    own effect is about the size of the zero-init noise, so their direction and scale are inconclusive (not failures);
    the targets with a clear effect (kv_a_proj_with_mqa, o_proj) pass; re-evaluating reproduces it."""
    from lora_parity.evidence.receipt import load

    from .conftest import ROOT

    receipt = load(ROOT / "receipts" / "tiny-glm-dsa.std-0.02__hf__vllm__h200.json")[0]
    for status in ({c.id: c.status for c in receipt.checks},
                   by_id(checks.evaluate(receipt.scores, receipt.budgets, errored=False))):
        for kind in ("q_a_proj", "q_b_proj"):
            assert status[f"T.{kind}.cosine"] == CheckStatus.INCONCLUSIVE
        for kind in ("kv_a_proj_with_mqa", "o_proj"):
            assert status[f"T.{kind}.cosine"] == CheckStatus.PASS and status[f"T.{kind}.scale"] == CheckStatus.PASS


def test_budgets_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="mean <= p99 <= max"):
        Budgets(**{**SEED_BUDGETS.model_dump(), "max": 0.01})
    with pytest.raises(ValueError, match="min_stimulus"):
        Budgets(**{**SEED_BUDGETS.model_dump(), "min_stimulus": 0.01})


def test_not_passing_is_the_one_filter_of_checks_that_did_not_pass() -> None:
    # Phases up to stale only: C is not reached, and the update changed nothing (trainer_updated ==
    # stale), so B.stimulus is inconclusive.
    s = {k: const(-2.0) for k in ("base", "zero", "zero_repeat", "trainer_zero", "trainer_zero_repeat", "stale")}
    s["trainer_updated"] = const(-2.0)
    ev = checks.evaluate(s, SEED_BUDGETS, errored=False)
    statuses = by_id(ev)
    every = [c.id for c in checks.not_passing(ev.checks)]
    reached = [c.id for c in checks.not_passing(ev.checks, reached=True)]
    assert every == [c.id for c in ev.checks if statuses[c.id] != CheckStatus.PASS]
    assert "B.stimulus" in reached and statuses["B.stimulus"] == CheckStatus.INCONCLUSIVE
    assert "C.parity.mean" in every and "C.parity.mean" not in reached  # not reached
    assert reached == [i for i in every if statuses[i] != CheckStatus.NOT_REACHED]
    assert not any(statuses[i] == CheckStatus.PASS for i in every)
    assert checks.not_passing([]) == []
