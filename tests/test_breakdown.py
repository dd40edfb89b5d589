"""|diff| by trainer-logprob bucket and position quartile: hand-computed expectations, and verify."""

import json
from pathlib import Path

import pytest

from lora_parity.evidence.receipt import compute_digest
from lora_parity.util.errors import ReceiptError
from lora_parity.verdict import breakdown
from lora_parity.verdict.verify import verify

from .conftest import cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("lp", "bucket"), [(0.0, 0), (-0.5, 0), (-1.0, 1), (-4.99, 1), (-5.0, 2), (-9.9, 2),
                                            (-10.0, 3), (-30.0, 3)])
def test_logprob_buckets_edges_belong_to_the_lower_bucket(lp: float, bucket: int) -> None:
    assert breakdown.logprob_bucket(lp) == bucket


def test_position_quartiles() -> None:
    assert [breakdown.position_quartile(t, 8) for t in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [breakdown.position_quartile(t, 3) for t in range(3)] == [0, 1, 2]
    assert [breakdown.position_quartile(t, 1) for t in range(1)] == [0]


def test_breakdown_by_hand() -> None:
    trainer = [[-0.5, -2.0, -7.0, -12.0], [-0.1, -0.2]]
    sampler = [[-0.6, -2.0, -7.5, -11.0], [-0.1, -0.5]]
    b = breakdown.breakdown(sampler, trainer)
    by_lp = {x.bucket: (x.n, x.mean_abs, x.max_abs) for x in b.by_logprob}
    assert by_lp["lp > -1"][0] == 3 and by_lp["lp > -1"][1] == pytest.approx((0.1 + 0.0 + 0.3) / 3)
    assert by_lp["lp > -1"][2] == pytest.approx(0.3)
    assert by_lp["-5 < lp <= -1"] == (1, 0.0, 0.0)
    assert by_lp["-10 < lp <= -5"] == (1, 0.5, 0.5)
    assert by_lp["lp <= -10"] == (1, 1.0, 1.0)
    by_pos = {x.bucket: (x.n, x.mean_abs) for x in b.by_position}
    # sequence 0 (4 positions): one per quartile; sequence 1 (2 positions): q1 and q3
    assert by_pos["q1"][0] == 2 and by_pos["q1"][1] == pytest.approx(0.05)
    assert by_pos["q2"] == (1, 0.0) and by_pos["q4"] == (1, 1.0)
    assert by_pos["q3"][0] == 2 and by_pos["q3"][1] == pytest.approx(0.4)


def test_empty_bucket_has_no_mean() -> None:
    b = breakdown.breakdown([[-20.0, -20.0]], [[-20.0, -20.0]])
    assert [x.n for x in b.by_logprob] == [0, 0, 0, 2] and b.by_logprob[0].mean_abs is None


def test_misaligned_scores_raise() -> None:
    with pytest.raises(ValueError, match="not aligned"):
        breakdown.breakdown([[0.0, 0.0]], [[0.0]])


def test_compute_covers_a_and_c_where_scored() -> None:
    scores = {"zero": [[-1.5, -0.5]], "trainer_zero": [[-1.5, -0.4]]}
    assert set(breakdown.compute(scores)) == {"A.trainer_vs_sampler"}


def _tamper(path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    data["digest"] = compute_digest(data)
    out = path.with_name("tampered.json")
    out.write_text(json.dumps(data))
    return out


def test_verify_recomputes_the_breakdown(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert cli("run", "--trainer", "fake", "--sampler", "fake", "--out", str(out)).returncode == 0
    verify(out)

    def shift(data: dict) -> None:
        cell = data["breakdown"]["C.trainer_vs_sampler"]["by_position"][2]
        cell["mean_abs"] = cell["mean_abs"] * 1.5 + 1e-9

    with pytest.raises(ReceiptError, match=r"breakdown C\.trainer_vs_sampler q3 does not reproduce"):
        verify(_tamper(out, shift))

    def drop(data: dict) -> None:
        del data["breakdown"]["A.trainer_vs_sampler"]

    with pytest.raises(ReceiptError, match="breakdown does not cover"):
        verify(_tamper(out, drop))

    def absent(data: dict) -> None:
        data["breakdown"] = None

    verify(_tamper(out, absent))  # receipts made before the breakdown existed still verify
