import math

import pytest

from lora_parity.util.errors import ScoreError
from lora_parity.verdict import stats

pytestmark = pytest.mark.unit


def test_summarize_hand_computed() -> None:
    a = [[0.0, 0.0], [0.0, 0.0, 0.0]]
    b = [[0.1, -0.2], [0.0, 0.4, -0.3]]
    s = stats.summarize(a, b, over=0.25)
    assert s["n"] == 5
    assert s["mean_abs"] == pytest.approx(1.0 / 5)
    assert s["max_abs"] == pytest.approx(0.4)
    assert s["argmax"] == [1, 1]
    assert s["p50"] == pytest.approx(0.2)
    # sorted |d| = 0, .1, .2, .3, .4; p99 at position 3.96 -> .3 + .96 * .1
    assert s["p99"] == pytest.approx(0.396)
    assert s["frac_over"] == pytest.approx(2 / 5)
    diffs = [0.1, -0.2, 0.0, 0.4, -0.3]
    assert s["k3_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in diffs) / 5)
    assert s["mult_prob_error"] == pytest.approx(sum(math.exp(abs(d)) for d in diffs) / 5)


def test_quantile_matches_linear_interpolation() -> None:
    values = sorted([3.0, 1.0, 2.0, 10.0])
    assert stats.quantile(values, 0.0) == 1.0
    assert stats.quantile(values, 1.0) == 10.0
    assert stats.quantile(values, 0.5) == pytest.approx(2.5)


def test_misaligned_arrays_are_refused() -> None:
    with pytest.raises(ScoreError, match="sequence 1 has 2 vs 3"):
        stats.summarize([[0.0], [0.0, 0.0]], [[0.0], [0.0, 0.0, 0.0]], over=0.1)
    with pytest.raises(ScoreError, match="1 vs 2 sequences"):
        stats.differences([[0.0]], [[0.0], [0.0]])


def test_non_finite_named_by_position() -> None:
    with pytest.raises(ScoreError, match="sequence 1, position 0"):
        stats.check_finite([[0.0], [math.nan]], "zero")
    with pytest.raises(ScoreError):
        stats.check_finite([[math.inf]], "zero")


def test_delta_agreement_signs_and_scale() -> None:
    before = [[0.0, 0.0, 0.0]]
    trainer_after = [[1.0, -2.0, 0.5]]
    same = stats.delta_agreement(before, trainer_after, before, trainer_after)
    assert same["cosine"] == pytest.approx(1.0) and same["scale"] == pytest.approx(1.0)
    assert same["rel_l2"] == pytest.approx(0.0)
    flipped = stats.delta_agreement(before, [[-1.0, 2.0, -0.5]], before, trainer_after)
    assert flipped["cosine"] == pytest.approx(-1.0) and flipped["rel_l2"] == pytest.approx(2.0)
    doubled = stats.delta_agreement(before, [[2.0, -4.0, 1.0]], before, trainer_after)
    assert doubled["scale"] == pytest.approx(2.0) and doubled["cosine"] == pytest.approx(1.0)


def test_delta_agreement_undefined_without_change() -> None:
    z = [[0.0, 0.0]]
    d = stats.delta_agreement(z, [[0.1, 0.2]], z, z)
    assert d["cosine"] is None and d["scale"] is None and d["rel_l2"] is None
    assert d["sampler_norm"] > 0 and d["trainer_norm"] == 0
